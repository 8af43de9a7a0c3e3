"""How many variants of each of our Triton kernels an engine compiles, without a GPU.

    python scripts/jit_variants.py

Per launcher case of tests/csrc_triton/test_jit_variants.py (its shapes, an H200's 132 SMs): the
distinct compile keys at the sizes an engine runs before it is ready (our warm-up steps, vLLM 0.26's
default CUDA-graph capture sizes, the profile run's 8,192 tokens) and over those plus the test's
serving sizes; the difference is what would compile while serving. Each call site of a kernel with
other dimensions in the model is another such set. A count, not a test: the test asserts the second
adds nothing.
"""

from __future__ import annotations

import sys
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CAPTURE_SIZES = (1, 2, 4, *range(8, 256, 8), *range(256, 513, 16))  # vLLM 0.26's defaults up to 512


def main() -> None:
    from tests.csrc_triton import test_jit_variants as cases

    ready_sizes = sorted(set(cases.READY_SIZES) | set(CAPTURE_SIZES))
    all_sizes = sorted(set(ready_sizes) | set(cases.STEP_SIZES))
    totals = [0, 0]
    print(f"{'launcher case':18s} {'before ready':>12s} {'all sizes':>10s}")
    with mock.patch.object(cases.mhc, "_sm_count", lambda device: 132):
        for case in cases.BY_TOKENS:
            kernel, launcher, build = case.values
            counts = [len(set().union(*cases.keys_at(kernel, launcher, build, sizes).values()))
                      for sizes in (ready_sizes, all_sizes)]
            totals = [t + c for t, c in zip(totals, counts)]
            print(f"{case.id:18s} {counts[0]:12d} {counts[1]:10d}")
    print(f"{'total':18s} {totals[0]:12d} {totals[1]:10d}")


if __name__ == "__main__":
    main()
