"""vllm-dsv4: DeepSeek-V4 served by vLLM as an out-of-tree plugin (entry point: plugin.register)."""

import logging

__version__ = "0.1.0"


def get_logger(name: str) -> logging.Logger:
    """``name``'s logger under vLLM's ``vllm`` logger, the only one vLLM configures: our records print
    with its handlers and level (a ``vllm_dsv4.*`` logger of its own reached Python's last-resort
    handler, which drops INFO: the warm-up's timings, which attention kernel runs)."""
    return logging.getLogger(f"vllm.{name}")
