"""The caches as vLLM sees them: each component's byte layout (layout.py), its vLLM spec (spec.py),
the layer that owns its pages (layer.py), the backend that names them (backend.py) and the per-step
metadata with its builder (metadata.py)."""
