"""Steps run before the engine reports ready, so that Triton compiles our kernels then, not while serving.

Triton compiles a kernel variant the first time a launch needs it: seconds per variant, a stall of
every request in the step. vLLM's own pre-ready steps leave variants out: its profile run binds no
KV cache (our attention skips), CUDA-graph capture runs decode steps only and none under
``enforce_eager``. So after vLLM's kernel warm-up (compat.py, ledger 12) the model runner takes, for
each power of two up to ``WARM_UP_TOKENS``, a decode step of that many requests and a mixed step of
that many tokens (decodes + one prefill: the prefill path of attention, the compressor's, the
indexer's and FlashMLA's). The kernels choose their variants by step size only at powers of two or
at thresholds between them, and not at all by a step's lengths
(tests/csrc_triton/test_jit_variants.py holds them to these sizes); the profile run covers
``max_num_batched_tokens``.
"""

from __future__ import annotations

import logging
import time

logger = logging.getLogger(__name__)

WARM_UP_TOKENS = 1024  # a mixed step this size scores its queries with the indexer's prefill tile (512+)


def warm_up_sizes(max_tokens: int) -> list[int]:
    """Token counts of the warm-up steps: 1, 2, 4, ... up to ``WARM_UP_TOKENS`` and ``max_tokens``."""
    return [1 << k for k in range(WARM_UP_TOKENS.bit_length()) if 1 << k <= min(WARM_UP_TOKENS, max_tokens)]


def warm_up_kernels(runner) -> None:
    """Runs the warm-up steps on a vLLM model runner (GPU or CPU): dummy steps with attention metadata,
    every row bound to the null block as in CUDA-graph capture, outputs discarded. Every rank of a
    data-parallel engine runs the same steps (they synchronise as vLLM's own warm-up steps do)."""
    started = time.perf_counter()
    decode_tokens = runner.uniform_decode_query_len  # 1, or 1 + draft tokens with MTP
    for tokens in warm_up_sizes(runner.scheduler_config.max_num_batched_tokens):
        if tokens % decode_tokens == 0 and tokens <= runner.max_num_reqs * decode_tokens:
            runner._dummy_run(tokens, force_attention=True, uniform_decode=True, skip_eplb=True, is_profile=True)
        if tokens >= 2 and runner.max_num_reqs >= 2:
            runner._dummy_run(tokens, force_attention=True, create_mixed_batch=True, skip_eplb=True, is_profile=True)
    logger.info("vllm-dsv4: warm-up steps took %.1f s", time.perf_counter() - started)
