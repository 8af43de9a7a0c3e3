"""Work run before the engine reports ready, so that our kernels compile then, not while serving.

Triton compiles a kernel variant the first time a launch needs it: seconds per variant, a stall of
every request in the step. vLLM's own pre-ready steps leave variants out: its profile run binds no
KV cache (our attention skips), CUDA-graph capture runs decode steps only and none under
``enforce_eager``. So after vLLM's kernel warm-up (patches.py, patch 4) the model runner takes, for
each power of two up to ``WARM_UP_TOKENS``, a decode step of that many requests and a mixed step of
that many tokens (decodes + one prefill: the prefill path of attention, the compressor's, the
indexer's and FlashMLA's). The kernels choose their variants by step size only at powers of two or
at thresholds between them, and not at all by a step's lengths
(tests/csrc_triton/test_jit_variants.py holds them to these sizes); the profile run covers
``max_num_batched_tokens``. Last, our DeepGEMM-backed FP8 linears run at the token counts vLLM's
DeepGEMM warm-up uses for its own layers, which it finds by class and so never ours.
"""

from __future__ import annotations

import contextlib
import time

import torch

from vllm_dsv4 import envs, get_logger
from vllm_dsv4.model.attention import Attention
from vllm_dsv4.model.layers import Linear
from vllm_dsv4.ops import vllm_kernels

logger = get_logger(__name__)

WARM_UP_TOKENS = 1024  # a mixed step this size scores its queries with the indexer's prefill tile (512+)
WARM_UP = envs.WARMUP.read()  # "skip": no warm-up steps (envs.py)


def warm_up_sizes(max_tokens: int) -> list[int]:
    """Sizes of the warm-up steps, 1, 2, 4, ... up to ``WARM_UP_TOKENS`` and ``max_tokens``: a decode
    step's requests (one token each without MTP), a mixed step's tokens."""
    return [1 << k for k in range(WARM_UP_TOKENS.bit_length()) if 1 << k <= min(WARM_UP_TOKENS, max_tokens)]


def warm_up_deep_gemm(model: torch.nn.Module, max_tokens: int) -> int:
    """Runs each DeepGEMM user of ``model`` (FP8 linears; ``wo_a``'s grouped GEMM, which takes steps over
    the fused kernel's sizes), once per weight shape, at the token counts vLLM's DeepGEMM warm-up runs
    its own linear layers at (``VLLM_DEEP_GEMM_WARMUP``; vllm_kernels.py, binding 5): DeepGEMM compiles a
    kernel per choice of tiles, which changes with the count, and vLLM's warm-up does not see our
    layers. Returns the calls made."""
    shapes, calls = set(), 0
    for module in model.modules():
        target = _deep_gemm_target(module)
        if target is None or target[0] in shapes:
            continue
        shape, rows, device, make_call = target
        shapes.add(shape)
        sizes = vllm_kernels.deep_gemm_warmup_sizes(rows, device, max_tokens)
        call = make_call(max(sizes, default=0))
        for tokens in sizes:
            call(tokens)
            calls += 1
    return calls


def _deep_gemm_target(module: torch.nn.Module) -> tuple | None:
    """(weight shape, output rows, device, most tokens -> call at n tokens) where ``module`` computes
    with DeepGEMM, else None."""
    if isinstance(module, Linear):
        gemm = next((g for g in module.gemms if g.deep_gemm), None)
        if gemm is None:
            return None
        rows, cols, device = module.out_features // module.groups, module.in_features, module.weight.device

        def make_call(max_tokens: int):
            x = torch.zeros(max_tokens, cols, dtype=torch.bfloat16, device=device)
            return lambda n: gemm(x[:n])

        return (rows, cols), rows, device, make_call
    if isinstance(module, Attention) and module.wo_a.grouped_gemm is not None:
        wo_a, device = module.wo_a, module.wo_a.weight.device

        def make_call(max_tokens: int):
            o = torch.zeros(max_tokens, module.num_heads, module.head_dim, dtype=torch.bfloat16, device=device)
            positions = torch.zeros(max_tokens, dtype=torch.int64, device=device)
            return lambda n: module.out_proj(o[:n], positions[:n])

        return ("wo_a", wo_a.out_features, wo_a.in_features), module.o_rank, device, make_call
    return None


def warm_up_kernels(runner) -> None:
    """Runs the warm-up steps on a vLLM model runner (GPU or CPU): dummy steps with attention metadata,
    every row bound to the null block as in CUDA-graph capture, outputs discarded. Every rank of a
    data-parallel engine runs the same steps (they synchronise as vLLM's own warm-up steps do)."""
    if WARM_UP == "skip":
        logger.info("vllm-dsv4: warm-up steps skipped (VLLM_DSV4_WARMUP=skip): kernels compile on first use")
        return
    started = time.perf_counter()
    max_tokens = runner.scheduler_config.max_num_batched_tokens
    query_tokens = runner.uniform_decode_query_len  # a decode's: 1, or 1 + its draft tokens with MTP
    took = []  # (step, seconds): where a cold start's compiles fall (a warm step takes milliseconds)
    for size in warm_up_sizes(max_tokens):
        if size <= runner.max_num_reqs and size * query_tokens <= max_tokens:  # size decodes
            with _timed(took, f"decode {size}"):
                runner._dummy_run(size * query_tokens, force_attention=True, uniform_decode=True, skip_eplb=True,
                                  is_profile=True)
        if size >= 2 and runner.max_num_reqs >= 2:  # size tokens: decodes + one prefill
            _place_mixed_step(runner.positions, size, runner.max_num_reqs)
            with _timed(took, f"mixed {size}"):
                runner._dummy_run(size, force_attention=True, create_mixed_batch=True, skip_eplb=True,
                                  is_profile=True)
    runner.positions.zero_()  # as vLLM left it
    with _timed(took, "DeepGEMM"):
        gemm_calls = warm_up_deep_gemm(runner.get_model(), max_tokens)
    logger.info("vllm-dsv4: warm-up steps and %d DeepGEMM calls took %.1f s (%s)", gemm_calls,
                time.perf_counter() - started, ", ".join(f"{step} {seconds:.1f}" for step, seconds in took))


@contextlib.contextmanager
def _timed(took: list, step: str):
    """Appends ``(step, seconds)`` to ``took`` once the block has run and its GPU work finished."""
    started = time.perf_counter()
    yield
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    took.append((step, time.perf_counter() - started))


def _place_mixed_step(positions: torch.Tensor, tokens: int, max_reqs: int) -> None:
    """Positions for vLLM's mixed dummy step of ``tokens`` (``_dummy_run(create_mixed_batch=True)``:
    min(max_reqs - 1, tokens // 2) decodes of sequence length 1, then one prefill of the rest, of
    sequence length rest + 1): the decodes at 0, the prefill at 1 .. rest, as a real step would have
    them, so that its queries see compressed entries and attention's reads of those run too (with
    vLLM's zeros they see none)."""
    decodes = min(max_reqs - 1, tokens // 2)
    positions[:decodes] = 0
    positions[decodes:tokens] = torch.arange(1, tokens - decodes + 1, device=positions.device)
