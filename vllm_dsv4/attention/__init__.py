"""Attention backend and per-step metadata for the model-owned DeepSeek-V4 cache layers."""
