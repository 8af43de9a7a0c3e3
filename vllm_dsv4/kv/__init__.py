"""KV-cache components: their byte layout (layout.py) and the vLLM specs built from it (spec.py)."""
