"""DeepSeek-V4 ops: pure-PyTorch references (``<op>_ref.py``) and, later, Triton kernels (``<op>.py``).

The references mirror sections of ``docs/MODEL.md`` and are also the CPU path
inside vLLM, so they are production code: batched over tokens, fp32 inside, torch-only imports.
``vllm_dsv4/ops/`` chooses between reference and kernel once, at import. The chain of trust is
transformers (fp32 oracle, ``tests/oracle``) -> reference -> kernel (``tests/csrc_triton``).
"""
