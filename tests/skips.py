"""The skips a run without CUDA may have; tests/conftest.py fails such a run on any other skip.

A test marked ``gpu`` skips without CUDA. Besides those, the CI runs the Triton tests in two
processes (.ci/run), because Triton decides at import whether it interprets: each reason below
skips a test that the other process runs.
"""

KERNELS_RUN_INTERPRETED = (
    "no CUDA: run the kernel tests in their own process, TRITON_INTERPRET=1 pytest tests/csrc_triton -k kernel"
)
COMPILES_RUN_UNINTERPRETED = "compiles kernels, which the interpreter replaces: runs without TRITON_INTERPRET"

ALLOWED_WITHOUT_CUDA = frozenset({KERNELS_RUN_INTERPRETED, COMPILES_RUN_UNINTERPRETED})
