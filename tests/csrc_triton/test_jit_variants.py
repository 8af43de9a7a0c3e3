"""Our Triton kernels compile before the engine is ready, never while it serves.

Triton compiles a kernel once per key: its launch options, its constexprs (the launcher's tile
choices) and the specialisation of every other argument (an int equal to 1 becomes a constant,
ints and pointers divisible by 16 get that hint). An argument that follows the step's token count
or length would compile a new variant, seconds of stall, the first time a step of a new shape class
arrives while serving. Here each launcher runs on CPU tensors at many step sizes with its kernels'
launches captured (nothing runs) and Triton's own specialisation of the captured arguments is
compared:

- the runtime arguments specialise alike at every step size (``do_not_specialize`` for counts;
  the model rounds entry-list widths up to multiples of 16, ``compressor.visible_entries``);
- every tile choice a step size makes is also made at a size the engine runs before it is ready:
  our warm-up steps (``warmup.py``: decode and mixed steps of 1, 2, 4, ... 1,024 tokens)
  and vLLM's profile run (``max_num_batched_tokens``, 8,192 by default); CUDA-graph capture adds
  decode sizes, which this check does not count on (none are captured under ``enforce_eager``).

Shapes are small where the dimension does not enter a tile choice: building arguments for 8,192
tokens at V4-Flash's dimensions would take minutes on a CPU.
"""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("triton")

from csrc_triton import (  # noqa: E402
    cache_index, compressor, indexer_topk, kv_cache, kv_insert, mhc, moe_mxfp4, norm, out_proj, rope, routing,
    sparse_attn,
)
from tests.csrc_triton import kernel_cases as kc  # noqa: E402
from tests.csrc_triton.kernel_cases import INTERPRET  # noqa: E402
from tests.csrc_triton.test_compile_hopper import (  # noqa: E402
    V4_INDEX, V4_MAIN, captured_launches, launch_specialisation,
)
from tests.skips import COMPILES_RUN_UNINTERPRETED  # noqa: E402
from vllm_dsv4.warmup import warm_up_sizes  # noqa: E402

pytestmark = pytest.mark.skipif(INTERPRET, reason=COMPILES_RUN_UNINTERPRETED)

PROFILE_TOKENS = 8192  # vLLM's profile run at its default max_num_batched_tokens
READY_SIZES = (*warm_up_sizes(PROFILE_TOKENS), PROFILE_TOKENS)
# step sizes in between (odd ones, sizes past the captures, a remainder chunk)
STEP_SIZES = (3, 5, 17, 100, 513, 777, 1000, 1025, 2049, 4095, 8191)
# entry-list widths the model passes: multiples of 16 (visible_entries), the window's 128, top-k 512
WIDTHS = (16, 32, 128, 144, 512, 1040, 4096)


@pytest.fixture(autouse=True)
def h200_sm_count(monkeypatch):
    """Launchers that size their grids by the SM count see an H200's 132, as on the device."""
    monkeypatch.setattr(mhc, "_sm_count", lambda device: 132)


def key(kernel, args: tuple, kwargs: dict) -> tuple[tuple, tuple]:
    """(tile choice, runtime specialisation) of one launch: the two parts of Triton's cache key for
    it (``JITFunction.run``). Tile choice: constexpr values, launch options, tensor dtypes. Runtime:
    per other argument its type and hint as the launcher binds it, a tensor's alignment hint."""
    tiles, runtime = [], []
    for _, param, value, kind, hint in launch_specialisation(kernel, args, kwargs):
        if param.is_constexpr:
            tiles.append((param.name, value))
        elif torch.is_tensor(value):  # its dtype is the launcher's choice (fp32 partial sums, say)
            tiles.append((param.name, kind))
            runtime.append((param.name, hint))
        else:
            runtime.append((param.name, kind, hint))
    options = sorted((k, v) for k, v in kwargs.items() if k not in kernel.arg_names)
    return tuple(tiles + options), tuple(runtime)


def keys_at(kernel, launcher, build, sizes) -> dict[tuple, dict]:
    """Per size, the keys of every launch of ``kernel`` that ``launcher(*build(size))`` makes."""
    return {size: {key(kernel, a, kw) for a, kw in captured_launches(kernel, launcher, *build(size))}
            for size in sizes}


@functools.cache
def _expert_weights() -> tuple:
    return kc.moe_mxfp4_args(1, 128, 64, 256, 6, torch.bfloat16, device="cpu")[3:]


def experts(T: int) -> tuple:
    """256 experts (the tile choice compares pairs with experts), top-6; small experts, drawn once."""
    g = torch.Generator().manual_seed(T)
    ids = torch.randint(0, 257, (T, 6), generator=g)  # id 256: another rank's expert, skipped
    return torch.randn(T, 128, generator=g).bfloat16(), torch.rand(T, 6, generator=g), ids, *_expert_weights()


def paged_indexer(B: int, N: int = 2048) -> tuple:
    return kc.indexer_paged_args([min(N, 7 * i + 1) for i in range(B)], [i % 3 for i in range(B)], 3, N, 16, 128,
                                 512, 64, V4_INDEX, torch.bfloat16, device="cpu")


def hyper_streams(T: int) -> tuple:
    """mhc_pre's arguments at V4-Flash's n = 4, D = 4096 (its split of the n*D axis is a tile choice);
    x uninitialised (values do not enter a key), the rest drawn once."""
    return torch.empty(T, 4, 4096, dtype=torch.bfloat16), *_mhc_parameters()


def hyper_head(T: int) -> tuple:
    """hc_head's arguments at V4-Flash's n = 4, D = 4096, the final norm fused (as the model calls it)."""
    return torch.empty(T, 4, 4096, dtype=torch.bfloat16), *_hc_head_parameters()


@functools.cache
def _hc_head_parameters() -> tuple:
    return kc.hc_head_args(1, 4, 4096, torch.bfloat16, norm=True, device="cpu")[1:]


@functools.cache
def _mhc_parameters() -> tuple:
    return kc.mhc_pre_args(1, 4, 4096, torch.bfloat16, device="cpu")[1:]


MOE = functools.partial(moe_mxfp4.moe_experts_mxfp4, narrow_scales=True)


def moe_with_shared(x, *args):
    """The MoE as the model calls it: the shared expert's output added in the k-sum's launch."""
    return MOE(x, *args, shared=torch.empty_like(x))


# (kernel, launcher, arguments for a step of T tokens); T = a decode batch's or a prefill's tokens
BY_TOKENS = [
    pytest.param(rope._rope_tail_kernel, rope.apply_rope_tail,
                 lambda T: kc.rope_args(T, (8,), 128, 64, torch.bfloat16, inverse=True, device="cpu"), id="rope"),
    pytest.param(rope._rope_tail_kernel, rope.norm_rope_tail,
                 lambda T: kc.norm_rope_args(T, (8,), 128, 64, torch.bfloat16, device="cpu"), id="norm-rope"),
    pytest.param(norm._rms_norm_kernel, norm.rms_norm,
                 lambda T: kc.rms_norm_args((T,), 1024, dtype=torch.bfloat16, device="cpu"), id="rms-norm"),
    pytest.param(norm._rms_norm_kernel, norm.rms_norm,
                 lambda T: kc.rms_norm_args((T,), 128, dtype=torch.bfloat16, device="cpu"), id="rms-norm-narrow"),
    pytest.param(compressor._compress_windows_kernel, compressor.pool_state_windows,
                 lambda T: kc.pool_windows_args(T, 4, 64, True, E=16, device="cpu"), id="compress-csa"),
    pytest.param(compressor._write_state_kernel, compressor.write_state_rows,
                 lambda T: kc.state_write_args(T, 128, 4, E=64, R=16, max_blocks=16, device="cpu"), id="state-write"),
    pytest.param(kv_insert._norm_rope_insert_kernel, kv_insert.norm_rope_insert,
                 lambda T: kc.kv_insert_args(T, 512, 64, V4_MAIN, x_dtype=torch.bfloat16, R=16, max_blocks=16, E=64,
                                             device="cpu"), id="kv-insert-main"),
    pytest.param(kv_insert._norm_rope_insert_kernel, kv_insert.norm_rope_insert,
                 lambda T: kc.kv_insert_args(T, 128, 64, V4_INDEX, x_dtype=torch.bfloat16, R=16, max_blocks=16, E=64,
                                             device="cpu"), id="kv-insert-index"),
    # a prefill's span rows ([T])
    pytest.param(kv_cache._read_kernel, kv_cache.read_entries,
                 lambda T: kc.kv_read_args((T,), (T,), 4, 16, 64, V4_MAIN, out_dtype=torch.bfloat16, device="cpu"),
                 id="kv-read-spans"),
    pytest.param(kv_cache._write_kernel, kv_cache.write_entries,
                 lambda T: kc.kv_write_args(1, T, 160, 64, V4_MAIN, values_dtype=torch.bfloat16, device="cpu"),
                 id="kv-write"),
    pytest.param(cache_index._global_slots_kernel, cache_index.global_slots,
                 lambda T: kc.cache_index_args(T, 128, device="cpu") + (128,), id="cache-index"),
    pytest.param(mhc._mhc_mix_kernel, mhc.mhc_pre, hyper_streams, id="mhc-mix"),
    pytest.param(mhc._mhc_pre_kernel, mhc.mhc_pre, hyper_streams, id="mhc-pre"),
    pytest.param(mhc._mhc_pre_kernel, functools.partial(mhc.mhc_pre, norm_weight=torch.ones(4096), norm_eps=1e-6),
                 hyper_streams, id="mhc-pre-norm"),
    pytest.param(mhc._mhc_pre_kernel, mhc.hc_head, hyper_head, id="mhc-head"),
    pytest.param(mhc._mhc_post_kernel, mhc.mhc_post,
                 lambda T: kc.mhc_post_args(T, 4, 512, torch.bfloat16, device="cpu"), id="mhc-post"),
    pytest.param(routing._route_kernel, routing.route, lambda T: kc.route_args(T, 256, 6, device="cpu"),
                 id="route-topk"),
    pytest.param(routing._route_kernel, routing.route, lambda T: kc.route_args(T, 256, 6, hashed=True, device="cpu"),
                 id="route-hash"),
    pytest.param(routing._swiglu_kernel, routing.swiglu_clamped,
                 lambda T: (torch.randn(T, 2 * 256).bfloat16(), 10.0), id="swiglu"),
    pytest.param(out_proj._rope_out_proj_kernel, out_proj.rope_out_proj,
                 lambda T: kc.out_proj_args(T, 8, 128, 64, 2, 128, torch.bfloat16, device="cpu"), id="wo-a-fused"),
    pytest.param(out_proj._rope_quant_kernel, out_proj.rope_quant_fp8,
                 lambda T: kc.out_proj_args(T, 8, 128, 64, 2, 128, torch.bfloat16, device="cpu")[:3] + (2,),
                 id="wo-a-quantise"),
    pytest.param(indexer_topk._indexer_scores_kernel, indexer_topk.indexer_topk_paged, paged_indexer,
                 id="indexer-scores"),
    pytest.param(indexer_topk._select_kernel, indexer_topk.indexer_topk_paged, paged_indexer, id="indexer-select"),
    pytest.param(sparse_attn._sparse_attn_kernel, sparse_attn.sparse_attn_cached,
                 lambda T: kc.sparse_attn_cached_args(T, 16, 64, 16, 32, None, torch.bfloat16, E=(64, 64),
                                                      entries=(256, 256), device="cpu"), id="sparse-attn"),
    *(pytest.param(kernel, MOE, experts, id=f"moe-{name}") for name, kernel in [
        ("w13", moe_mxfp4._w13_swiglu_kernel), ("w2", moe_mxfp4._w2_kernel), ("sum", moe_mxfp4._sum_k_kernel),
        ("counts", moe_mxfp4._expert_counts_kernel), ("place", moe_mxfp4._place_pairs_kernel)]),
    pytest.param(moe_mxfp4._sum_k_kernel, moe_with_shared, experts, id="moe-sum-shared"),
]
# (kernel, launcher, arguments for entry lists of width K): C128's visible entries and C4's scores
BY_WIDTH = [
    pytest.param(cache_index._global_slots_kernel, cache_index.global_slots,
                 lambda K: kc.cache_index_args(40, K, device="cpu") + (128,), id="cache-index"),
    pytest.param(indexer_topk._indexer_scores_kernel, indexer_topk.indexer_topk_paged,
                 lambda N: paged_indexer(24, N), id="indexer-scores"),
    pytest.param(indexer_topk._select_kernel, indexer_topk.indexer_topk_paged, lambda N: paged_indexer(24, N),
                 id="indexer-select"),
    pytest.param(sparse_attn._sparse_attn_kernel, sparse_attn.sparse_attn_cached,
                 lambda K: kc.sparse_attn_cached_args(24, 16, 64, 128, K, None, torch.bfloat16, E=(64, 64),
                                                      entries=(4096, 4096), device="cpu"), id="sparse-attn"),
]


def _runtime_differences(keys: dict[object, set]) -> list[str]:
    """The runtime arguments whose specialisation differs between the sizes' launches."""
    runtimes = {runtime for launches in keys.values() for _, runtime in launches}
    return sorted({f"{name}: {sorted({str(r[i][1:]) for r in runtimes})}"
                   for i, (name, *_) in enumerate(next(iter(runtimes)))
                   if len({r[i] for r in runtimes}) > 1})


@pytest.mark.parametrize("kernel, launcher, build", BY_TOKENS)
def test_token_count_leaves_runtime_specialisation_alone(kernel, launcher, build):
    keys = keys_at(kernel, launcher, build, (1, 2, 16, *STEP_SIZES))
    assert not _runtime_differences(keys), _runtime_differences(keys)


@pytest.mark.parametrize("kernel, launcher, build", BY_WIDTH)
def test_entry_width_leaves_runtime_specialisation_alone(kernel, launcher, build):
    keys = keys_at(kernel, launcher, build, WIDTHS)
    assert not _runtime_differences(keys), _runtime_differences(keys)
    assert len({tiles for launches in keys.values() for tiles, _ in launches}) == 1  # no tile choice by width


@pytest.mark.parametrize("kernel, launcher, build", BY_TOKENS)
def test_every_tile_choice_is_compiled_before_ready(kernel, launcher, build):
    ready = {tiles for launches in keys_at(kernel, launcher, build, READY_SIZES).values() for tiles, _ in launches}
    serving = keys_at(kernel, launcher, build, STEP_SIZES)
    missed = {size: tiles for size, launches in serving.items() for tiles, _ in launches if tiles not in ready}
    # per size, the choices no pre-ready size makes (SPLITS_P = 8, say)
    assert not missed, {size: [c for c in tiles if all(c not in r for r in ready)] for size, tiles in missed.items()}


def test_unspecialised_count_is_a_difference_the_check_sees():
    """The check's own control: the same launcher with ``do_not_specialize`` lifted from rms_norm's row
    count specialises 1, 16 and 17 rows three ways."""
    param = next(p for p in norm._rms_norm_kernel.params if p.name == "N")
    assert param.do_not_specialize
    build = next(case.values[2] for case in BY_TOKENS if case.id == "rms-norm")
    try:
        param.do_not_specialize = False
        differences = _runtime_differences(keys_at(norm._rms_norm_kernel, norm.rms_norm, build, (1, 16, 17)))
    finally:
        param.do_not_specialize = True
    assert differences == ["N: [\"('constexpr', 1)\", \"('i32', '')\", \"('i32', 'D')\"]"], differences
