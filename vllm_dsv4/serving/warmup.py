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

import torch

logger = logging.getLogger(__name__)

WARM_UP_TOKENS = 1024  # a mixed step this size scores its queries with the indexer's prefill tile (512+)


def warm_up_sizes(max_tokens: int) -> list[int]:
    """Sizes of the warm-up steps, 1, 2, 4, ... up to ``WARM_UP_TOKENS`` and ``max_tokens``: a decode
    step's requests (one token each without MTP), a mixed step's tokens."""
    return [1 << k for k in range(WARM_UP_TOKENS.bit_length()) if 1 << k <= min(WARM_UP_TOKENS, max_tokens)]


def warm_up_kernels(runner) -> None:
    """Runs the warm-up steps on a vLLM model runner (GPU or CPU): dummy steps with attention metadata,
    every row bound to the null block as in CUDA-graph capture, outputs discarded. Every rank of a
    data-parallel engine runs the same steps (they synchronise as vLLM's own warm-up steps do)."""
    started = time.perf_counter()
    max_tokens = runner.scheduler_config.max_num_batched_tokens
    query_tokens = runner.uniform_decode_query_len  # a decode's: 1, or 1 + its draft tokens with MTP
    for size in warm_up_sizes(max_tokens):
        if size <= runner.max_num_reqs and size * query_tokens <= max_tokens:  # size decodes
            runner._dummy_run(size * query_tokens, force_attention=True, uniform_decode=True, skip_eplb=True,
                              is_profile=True)
        if size >= 2 and runner.max_num_reqs >= 2:  # size tokens: decodes + one prefill
            _place_mixed_step(runner.positions, size, runner.max_num_reqs)
            runner._dummy_run(size, force_attention=True, create_mixed_batch=True, skip_eplb=True, is_profile=True)
    runner.positions.zero_()  # as vLLM left it
    logger.info("vllm-dsv4: warm-up steps took %.1f s", time.perf_counter() - started)


def _place_mixed_step(positions: torch.Tensor, tokens: int, max_reqs: int) -> None:
    """Positions for vLLM's mixed dummy step of ``tokens`` (``_dummy_run(create_mixed_batch=True)``:
    min(max_reqs - 1, tokens // 2) decodes of sequence length 1, then one prefill of the rest, of
    sequence length rest + 1): the decodes at 0, the prefill at 1 .. rest, as a real step would have
    them, so that its queries see compressed entries and attention's reads of those run too (with
    vLLM's zeros they see none)."""
    decodes = min(max_reqs - 1, tokens // 2)
    positions[:decodes] = 0
    positions[decodes:tokens] = torch.arange(1, tokens - decodes + 1, device=positions.device)
