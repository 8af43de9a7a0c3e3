"""vllm-dsv4: DeepSeek-V4 served by vLLM as an out-of-tree plugin (entry point: plugin.register)."""

__version__ = "0.1.0"
