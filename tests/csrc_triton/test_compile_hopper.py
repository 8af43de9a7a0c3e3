"""Our Triton kernels compile for Hopper (sm_90) on any machine, GPU or not.

Every kernel that a launcher of ``csrc_triton`` launches is compiled at least once, at V4-Flash shapes.
Each launcher runs on CPU tensors with its kernels' ``run`` captured; the captured launch is then
compiled for sm_90 through PTX to a cubin (Triton ships ptxas), with the argument specialisation
Triton's launcher applies (its own binding: an int equal to 1 becomes a constant, ints and pointers
divisible by 16 get that hint, except where ``do_not_specialize`` says), so the code the GPU would
build is built here. This catches what the interpreter accepts but the compiler does not (a kernel
reading a plain Python global, an unsupported op), and checks the resources an H200 launch needs:
shared memory within the 227 KiB a block may use, and the FP8 tensor-core instruction where a tile is
meant to use it. The local Triton may be newer than the device's (3.6 with vLLM 0.26); the GPU runs
are the final word.
"""

from __future__ import annotations

import functools
from unittest import mock

import pytest
import torch

triton = pytest.importorskip("triton")

from triton._C.libtriton import native_specialize_impl  # noqa: E402
from triton.backends.compiler import BaseBackend, GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from csrc_triton import (  # noqa: E402
    cache_index, compressor, indexer_topk, kv_cache, kv_insert, mhc, moe_mxfp4, norm, out_proj, rope, routing,
    sparse_attn,
)
from tests.csrc_triton.kernel_cases import (  # noqa: E402
    INTERPRET, cache_index_args, hc_head_args, indexer_args, indexer_paged_args, kv_insert_args, kv_read_args,
    kv_write_args, mhc_post_args, mhc_pre_args, moe_fp8_args, moe_mxfp4_args, norm_rope_args, out_proj_args,
    pool_windows_args,
    rms_norm_args, rope_args, route_args, sparse_attn_args, sparse_attn_cached_args, state_write_args,
)
from tests.skips import COMPILES_RUN_UNINTERPRETED  # noqa: E402
from vllm_dsv4.kv.layout import Fp8Entry  # noqa: E402

pytestmark = pytest.mark.skipif(INTERPRET, reason=COMPILES_RUN_UNINTERPRETED)

HOPPER = GPUTarget("cuda", 90, 32)
MAX_SHARED_BYTES = 227 * 1024  # per block on H100 / H200


def captured_launches(kernel, launcher, *args) -> list[tuple[tuple, dict]]:
    """The (positional, keyword) arguments of every launch of ``kernel`` that ``launcher(*args)`` makes.
    Every kernel's ``run`` is replaced, so that the launcher's other kernels do not run either."""
    launches = []

    def capture(self, *a, grid, warmup, **kw):
        if self is kernel:
            launches.append((a, kw))

    with mock.patch.object(JITFunction, "run", capture):
        launcher(*args)
    return launches


def launch_specialisation(kernel, args: tuple, kwargs: dict) -> list[tuple]:
    """Per parameter of one captured launch, ``(index, param, value, type, hint)`` as Triton's launcher
    binds it (its own ``specialize_impl``, honouring ``do_not_specialize``): a constexpr as
    ``("constexpr", value)``, an int equal to 1 as ``("constexpr", 1)``, ``"D"`` for an int or a
    pointer divisible by 16."""
    bound = dict(zip(kernel.arg_names, args)) | kwargs
    specs = []
    for index, param in enumerate(kernel.params):
        value = bound[param.name]
        if param.is_constexpr:
            kind, hint = "constexpr", value
        else:
            kind, hint = native_specialize_impl(BaseBackend, value, False, not param.do_not_specialize,
                                                not param.do_not_specialize_on_alignment)
        specs.append((index, param, value, kind, hint))
    return specs


def compile_for_hopper(kernel, args: tuple, kwargs: dict):
    """Compile one captured launch for sm_90 with the launcher's specialisation (module doc)."""
    options = {k: kwargs[k] for k in ("num_warps", "num_stages", "enable_fp_fusion") if k in kwargs}
    signature, constants, attrs = {}, {}, {}
    for index, param, value, kind, hint in launch_specialisation(kernel, args, kwargs):
        signature[param.name] = kind
        if kind == "constexpr":
            constants[(index,)] = hint
        elif hint == "D":
            attrs[(index,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(kernel, signature, constants, attrs), target=HOPPER, options=options)


# V4-Flash's wo_a at decode (narrow tiles, FP8 operands widened for mma.sync) and prefill (wgmma on e4m3)
@pytest.mark.parametrize("tokens, tensor_core_op",
                         [(1, "mma.sync"), (300, "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3")])
def test_out_proj_compiles_for_hopper(tokens, tensor_core_op):
    args = out_proj_args(tokens, 64, 512, 64, 8, 1024, torch.bfloat16, device="cpu")
    (launch,) = captured_launches(out_proj._rope_out_proj_kernel, out_proj.rope_out_proj, *args)
    compiled = compile_for_hopper(out_proj._rope_out_proj_kernel, *launch)
    assert compiled.metadata.shared <= MAX_SHARED_BYTES
    assert tensor_core_op in compiled.asm["ptx"]
    assert "cp.async" in compiled.asm["ptx"]  # the weight loads are pipelined
    # quantised as the reference quantises: scale = amax * fp32(1/448) (0f3B124925), an IEEE division by
    # it, no FMA contraction in the de-rotation
    assert "mul.rn.f32" in compiled.asm["ptx"] and "0f3B124925" in compiled.asm["ptx"]
    assert "div.rn.f32" in compiled.asm["ptx"] and "fma.rn.f32" not in compiled.asm["ptx"]


def test_rope_quant_compiles_for_hopper():
    """The de-rotating quantiser of the einsum path: V4-Flash's 64 heads of 512 in 8 groups, quantised
    with the fused kernel's arithmetic (the same PTX markers)."""
    o, positions, inv_freq, *_ = out_proj_args(16, 64, 512, 64, 8, 128, torch.bfloat16, device="cpu")
    (launch,) = captured_launches(out_proj._rope_quant_kernel, out_proj.rope_quant_fp8, o, positions, inv_freq, 8)
    compiled = compile_for_hopper(out_proj._rope_quant_kernel, *launch)
    assert compiled.metadata.shared <= MAX_SHARED_BYTES
    assert "mul.rn.f32" in compiled.asm["ptx"] and "0f3B124925" in compiled.asm["ptx"]
    assert "div.rn.f32" in compiled.asm["ptx"] and "fma.rn.f32" not in compiled.asm["ptx"]


V4_MAIN, V4_INDEX = Fp8Entry(512, 64), Fp8Entry(128, None)  # FP8 cache entries of 584 B, 132 B


@functools.cache
def v4_flash_experts(T: int) -> tuple:
    """V4-Flash's D and I with 2 local experts, not 256 (quantising 256 of them takes minutes on a CPU);
    the tile config depends on the rows per expert: T = 1 takes the decode config, T = 64 (192 rows
    per expert, as T > 682 with 256 experts) the batch one. Cached: three kernels share one build."""
    return moe_mxfp4_args(T, 4096, 2048, 2, 6, torch.bfloat16, device="cpu")


@functools.cache
def v4_flash_fp8_experts(T: int) -> tuple:
    """V4-Flash-Base's experts (FP8, float32 scales) at V4-Flash's D and I, as ``v4_flash_experts``."""
    return moe_fp8_args(T, 4096, 2048, 2, 6, torch.bfloat16, device="cpu")


@pytest.mark.parametrize("T", [1, 64], ids=["decode", "batch"])
@pytest.mark.parametrize("kernel", [moe_mxfp4._w13_swiglu_kernel, moe_mxfp4._w2_kernel], ids=["w13", "w2"])
def test_moe_decode_scales_code_pairs_in_bf16(kernel, T):
    """The experts' decode as the model runs it (narrow scales): each register of two codes scaled by
    one bf16x2 FMA, the weights never widened to fp32 (the decode's arithmetic bounds these kernels)."""
    launcher = functools.partial(moe_mxfp4.moe_experts_mxfp4, narrow_scales=True)
    (launch,) = captured_launches(kernel, launcher, *v4_flash_experts(T))
    ptx = compile_for_hopper(kernel, *launch).asm["ptx"]
    assert "fma.rn.bf16x2" in ptx
    assert "cvt.f32.bf16" not in ptx and "cvt.f32.f16" not in ptx


@pytest.mark.parametrize("kernel, launcher, make_args", [
    pytest.param(indexer_topk._indexer_scores_kernel, indexer_topk.indexer_topk_paged,
                 lambda: indexer_paged_args([8192, 4096, 513, 0], [0, 1, 2, -1], 3, 8192, 64, 128, 512, 64, V4_INDEX,
                                            torch.bfloat16, device="cpu"), id="indexer-paged"),
    pytest.param(sparse_attn._sparse_attn_kernel, sparse_attn.sparse_attn_cached,
                 lambda: sparse_attn_cached_args(32, 64, 512, 128, 512, V4_MAIN, torch.bfloat16, E=(64, 64),
                                                 entries=(4096, 4096), device="cpu"), id="sparse-attn-cached-fp8"),
])
def test_fp8_cache_reads_use_the_hardware_conversion(kernel, launcher, make_args):
    """On Hopper FP8 keys read from the caches go through the e4m3 conversion instruction (two codes
    each), not the integer decode that the interpreter and pre-sm_89 GPUs use (the indexer's SASS
    halved with it)."""
    (launch,) = captured_launches(kernel, launcher, *make_args())
    assert launch[1]["HW_E4M3"]
    ptx = compile_for_hopper(kernel, *launch).asm["ptx"]
    assert "e4m3x2" in ptx  # cvt.rn.f16x2.e4m3x2


@pytest.mark.parametrize("T", [1, 64], ids=["decode", "batch"])
@pytest.mark.parametrize("kernel", [moe_mxfp4._w13_swiglu_kernel, moe_mxfp4._w2_kernel], ids=["w13", "w2"])
def test_moe_fp8_weights_use_the_hardware_conversion(kernel, T):
    """V4-Flash-Base's FP8 expert weights go through the e4m3 conversion instruction, two codes each."""
    (launch,) = captured_launches(kernel, moe_mxfp4.moe_experts_fp8, *v4_flash_fp8_experts(T))
    assert "e4m3x2" in compile_for_hopper(kernel, *launch).asm["ptx"]


# (kernel, its launcher, the launcher's arguments); shapes from the kernel tests' V4-Flash cases
KERNEL_CASES = [
    pytest.param(rope._rope_tail_kernel, rope.apply_rope_tail,
                 lambda: rope_args(64, (64,), 512, 64, torch.bfloat16, inverse=True, device="cpu"), id="rope"),
    pytest.param(rope._rope_tail_kernel, rope.norm_rope_tail,
                 lambda: norm_rope_args(64, (64,), 512, 64, torch.bfloat16, device="cpu"), id="norm-rope"),
    pytest.param(norm._rms_norm_kernel, norm.rms_norm,
                 lambda: rms_norm_args((64,), 4096, dtype=torch.bfloat16, device="cpu"), id="rms-norm-hidden"),
    pytest.param(norm._rms_norm_kernel, norm.rms_norm,
                 lambda: rms_norm_args((64,), 1024, dtype=torch.bfloat16, device="cpu"), id="rms-norm-q-latent"),
    pytest.param(compressor._compress_windows_kernel, compressor.pool_state_windows,
                 lambda: pool_windows_args(300, 4, 512, True, E=64, device="cpu"), id="compress-csa"),
    pytest.param(compressor._compress_windows_kernel, compressor.pool_state_windows,
                 lambda: pool_windows_args(64, 128, 512, False, E=64, device="cpu"), id="compress-hca"),
    pytest.param(compressor._write_state_kernel, compressor.write_state_rows,
                 lambda: state_write_args(64, 1024, 4, device="cpu"), id="state-write"),
    pytest.param(indexer_topk._indexer_scores_kernel, indexer_topk.indexer_topk,
                 lambda: indexer_args([min(2048, (p + 1) // 4) for p in range(0, 40 * 211, 211)], 2048, 64, 128, 512,
                                      torch.bfloat16, device="cpu"), id="indexer-prefill"),
    pytest.param(indexer_topk._indexer_scores_kernel, indexer_topk.indexer_topk_paged,
                 lambda: indexer_paged_args([8192, 4096, 513, 0], [0, 1, 2, -1], 3, 8192, 64, 128, 512, 64, V4_INDEX,
                                            torch.bfloat16, device="cpu"), id="indexer-paged-fp8"),
    pytest.param(indexer_topk._indexer_scores_kernel, indexer_topk.indexer_topk_paged,
                 lambda: indexer_paged_args([min(2048, (p + 1) // 4) for p in range(0, 512 * 16, 16)], [0] * 512, 1,
                                            2048, 64, 128, 512, 64, V4_INDEX, torch.bfloat16, device="cpu"),
                 id="indexer-paged-prefill"),
    pytest.param(indexer_topk._select_kernel, indexer_topk.indexer_topk_paged,
                 lambda: indexer_paged_args([8192, 4096, 513, 0], [0, 1, 2, -1], 3, 8192, 64, 128, 512, 64, V4_INDEX,
                                            torch.bfloat16, device="cpu"), id="indexer-select"),
    pytest.param(kv_cache._read_kernel, kv_cache.read_entries,
                 lambda: kv_read_args((64, 1), (64, 640), 8, 16, 64, V4_MAIN, out_dtype=torch.bfloat16, device="cpu"),
                 id="kv-read-main"),
    pytest.param(kv_cache._read_kernel, kv_cache.read_entries,
                 lambda: kv_read_args((), (16384,), 2, 256, 64, V4_INDEX, out_dtype=torch.bfloat16, device="cpu"),
                 id="kv-read-index"),
    pytest.param(kv_cache._write_kernel, kv_cache.write_entries,
                 lambda: kv_write_args(16, 512, 16, 64, V4_MAIN, values_dtype=torch.bfloat16, device="cpu"),
                 id="kv-write-main"),
    pytest.param(kv_insert._norm_rope_insert_kernel, kv_insert.norm_rope_insert,
                 lambda: kv_insert_args(4096, 512, 64, V4_MAIN, x_dtype=torch.bfloat16, R=16, max_blocks=16, E=64,
                                        device="cpu"), id="kv-insert-main"),
    pytest.param(kv_insert._norm_rope_insert_kernel, kv_insert.norm_rope_insert,
                 lambda: kv_insert_args(4096, 128, 64, V4_INDEX, x_dtype=torch.bfloat16, R=16, max_blocks=16, E=64,
                                        device="cpu"), id="kv-insert-index"),
    pytest.param(mhc._mhc_mix_kernel, mhc.mhc_pre, lambda: mhc_pre_args(1, 4, 4096, torch.bfloat16, device="cpu"),
                 id="mhc-mix-decode"),
    pytest.param(mhc._mhc_mix_kernel, mhc.mhc_pre, lambda: mhc_pre_args(1000, 4, 4096, torch.bfloat16, device="cpu"),
                 id="mhc-mix-prefill"),
    pytest.param(mhc._mhc_pre_kernel, mhc.mhc_pre, lambda: mhc_pre_args(1, 4, 4096, torch.bfloat16, device="cpu"),
                 id="mhc-pre"),
    pytest.param(mhc._mhc_pre_kernel, mhc.mhc_pre,  # as the model calls it: the sub-layer's input norm fused
                 lambda: (*mhc_pre_args(1, 4, 4096, torch.bfloat16, device="cpu"), torch.ones(4096), 1e-6),
                 id="mhc-pre-norm"),
    pytest.param(mhc._mhc_pre_kernel, mhc.hc_head,  # the hyper-head with the final norm fused
                 lambda: hc_head_args(1, 4, 4096, torch.bfloat16, norm=True, device="cpu"), id="mhc-head"),
    pytest.param(mhc._mhc_post_kernel, mhc.mhc_post,
                 lambda: mhc_post_args(1000, 4, 4096, torch.bfloat16, device="cpu"), id="mhc-post"),
    pytest.param(routing._route_kernel, routing.route, lambda: route_args(4096, 256, 6, device="cpu"), id="route-topk"),
    pytest.param(routing._route_kernel, routing.route, lambda: route_args(4096, 256, 6, hashed=True, device="cpu"),
                 id="route-hash"),
    pytest.param(routing._swiglu_kernel, routing.swiglu_clamped,
                 lambda: (torch.randn(64, 2 * 2048).bfloat16(), 10.0), id="swiglu"),
    pytest.param(sparse_attn._sparse_attn_kernel, sparse_attn.sparse_attn,
                 lambda: sparse_attn_args(37, 64, 640, 512, torch.bfloat16, device="cpu"), id="sparse-attn-gathered"),
    pytest.param(sparse_attn._sparse_attn_kernel, sparse_attn.sparse_attn_cached,
                 lambda: sparse_attn_cached_args(32, 64, 512, 128, 512, V4_MAIN, torch.bfloat16, E=(64, 64),
                                                 entries=(4096, 4096), device="cpu"), id="sparse-attn-cached-fp8"),
    pytest.param(moe_mxfp4._w13_swiglu_kernel, moe_mxfp4.moe_experts_mxfp4, lambda: v4_flash_experts(1),
                 id="moe-w13-decode"),
    pytest.param(moe_mxfp4._w13_swiglu_kernel, moe_mxfp4.moe_experts_mxfp4, lambda: v4_flash_experts(64),
                 id="moe-w13-batch"),
    pytest.param(moe_mxfp4._w2_kernel, moe_mxfp4.moe_experts_mxfp4, lambda: v4_flash_experts(1), id="moe-w2-decode"),
    pytest.param(moe_mxfp4._w2_kernel, moe_mxfp4.moe_experts_mxfp4, lambda: v4_flash_experts(64), id="moe-w2-batch"),
    pytest.param(moe_mxfp4._w13_swiglu_kernel, moe_mxfp4.moe_experts_fp8, lambda: v4_flash_fp8_experts(1),
                 id="moe-fp8-w13-decode"),
    pytest.param(moe_mxfp4._w13_swiglu_kernel, moe_mxfp4.moe_experts_fp8, lambda: v4_flash_fp8_experts(64),
                 id="moe-fp8-w13-batch"),
    pytest.param(moe_mxfp4._w2_kernel, moe_mxfp4.moe_experts_fp8, lambda: v4_flash_fp8_experts(1),
                 id="moe-fp8-w2-decode"),
    pytest.param(moe_mxfp4._w2_kernel, moe_mxfp4.moe_experts_fp8, lambda: v4_flash_fp8_experts(64),
                 id="moe-fp8-w2-batch"),
    pytest.param(moe_mxfp4._expert_counts_kernel, moe_mxfp4.moe_experts_mxfp4, lambda: v4_flash_experts(64),
                 id="moe-expert-counts"),
    pytest.param(moe_mxfp4._place_pairs_kernel, moe_mxfp4.moe_experts_mxfp4, lambda: v4_flash_experts(64),
                 id="moe-place-pairs"),
    pytest.param(moe_mxfp4._sum_k_kernel, moe_mxfp4.moe_experts_mxfp4, lambda: v4_flash_experts(1), id="moe-sum-k"),
    pytest.param(moe_mxfp4._sum_k_kernel,  # with the shared expert's output, as the model calls it
                 lambda x, *args: moe_mxfp4.moe_experts_mxfp4(x, *args, shared=torch.empty_like(x)),
                 lambda: v4_flash_experts(1), id="moe-sum-shared"),
    pytest.param(cache_index._global_slots_kernel, cache_index.global_slots,
                 lambda: cache_index_args(64, 640, device="cpu") + (128,), id="cache-index"),
]


@pytest.mark.parametrize("kernel, launcher, build_args", KERNEL_CASES)
def test_kernel_compiles_for_hopper(kernel, launcher, build_args):
    (launch,) = captured_launches(kernel, launcher, *build_args())
    assert compile_for_hopper(kernel, *launch).metadata.shared <= MAX_SHARED_BYTES
