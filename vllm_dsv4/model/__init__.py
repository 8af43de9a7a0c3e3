"""DeepSeek-V4 layers, mirroring the official module tree so parameter names are checkpoint names."""
