"""Checkpoint reading: the official DeepSeek-V4 tensor table, validation and dequantisation."""
