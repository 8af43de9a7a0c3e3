"""Kernel vs reference on the GPU: µs, GB/s and % of H200 HBM peak (4.8 TB/s). A benchmark, not a test.

    python scripts/bench_kernels.py [--op sparse_attn] [--rep 200]

One case table (V4-Flash shapes, bf16 activations unless the op is fp32 by definition); inputs come
from tests/csrc_triton/kernel_cases.py, the same builders the kernel tests use. GB/s counts the bytes
the op must move (the ``*_bytes`` helpers there), so the % column is a roofline fraction for the
kernel line; the reference line is timed on the same bytes for comparison. Kernels are timed replayed
from a CUDA graph, as decode steps run them: timed eagerly, a decode-sized call can mostly measure
Python's launch cost (as eagerly timed MoE rows once did: about the same time at T = 1 and 16,
for 13 times the weight bytes). Each case first checks the
kernel against the reference (max abs diff printed) so a number never comes from a wrong kernel.
Skips (exit 0) without CUDA. Where the model can run another GPU implementation of an op (wo_a: the
inverse-RoPE kernel then vLLM's block-FP8 GEMM per head group, and our de-rotating quantiser then
DeepGEMM's grouped GEMM, which ``ops.OUT_PROJ=auto`` takes above 1,024 tokens where vLLM has it, against
our fused kernel; routed experts: vLLM's Marlin MXFP4 MoE against ours), that
is timed too, built as the model builds it under the vLLM config a worker loading DeepSeek-V4 has:
which one the model should run at which size is this table's question.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HBM_PEAK_BYTES_PER_S = 4.8e12
BF16 = torch.bfloat16


@dataclass(frozen=True)
class Case:
    """One row: ``build()`` gives the positional arguments shared by kernel and reference."""

    op: str
    label: str
    build: Callable[[], tuple]
    bytes_moved: int


def cases() -> list[Case]:
    from tests.csrc_triton import kernel_cases as kc
    from vllm_dsv4.kv.layout import Fp8Entry

    FP8_MAIN = Fp8Entry(512, 64)  # 584 B entries

    H, d, K = 64, 512, 128 + 512
    decode = dict(R=64, E=(64, 64), entries=(4096, 4096), p_hole=0.0, padding=False)
    c128 = dict(decode, E=(64, 2), entries=(4096, 8192), visible=300)
    # wo_a (64 heads of 512 into 8 groups of 1024) and the routed experts (256 of D=4096, I=2048, top-6),
    # at decode batches and a prefill chunk: the two ops whose production path is still open (module doc),
    # first, so a run cut short by its time limit still answers them
    rows = [Case("rope_out_proj", f"T={T} H=64 d=512 G=8 R=1024",
                 lambda T=T: kc.out_proj_args(T, 64, 512, 64, 8, 1024, BF16), kc.out_proj_bytes(T, 64, 512, 8, 1024, BF16))
            for T in (1, 16, 64, 1024, 8192)]
    # narrow_scales=True, as model/moe.py finds for these weights (scale bytes <= 128)
    rows += [Case("moe_experts_mxfp4", f"T={T} E=256 k=6 D=4096 I=2048",
                  lambda T=T: kc.moe_mxfp4_args(T, 4096, 2048, 256, 6, BF16, p_skip=0.0) + (True,),
                  kc.moe_mxfp4_bytes(T, 4096, 2048, 256, 6, BF16))
             for T in (1, 16, 64, 8192)]
    rows += [Case("moe_experts_fp8", f"T={T} E=256 k=6 D=4096 I=2048 (V4-Flash-Base)",
                  lambda T=T: kc.moe_fp8_args(T, 4096, 2048, 256, 6, BF16, p_skip=0.0),
                  kc.moe_fp8_bytes(T, 4096, 2048, 256, 6, BF16))
             for T in (1, 16, 64, 8192)]
    rows += [
        Case("sparse_attn", f"decode T=64 H={H} K={K} d={d}",
             lambda: kc.sparse_attn_args(64, H, K, d, BF16, p_valid=1.0, empty_row=False),
             kc.sparse_attn_bytes(64, H, K, d, BF16)),
        Case("sparse_attn", f"prefill T=1024 H={H} K={K} d={d}",
             lambda: kc.sparse_attn_args(1024, H, K, d, BF16, p_valid=1.0, empty_row=False),
             kc.sparse_attn_bytes(1024, H, K, d, BF16)),
        # Decode batches of 64 requests reading a 128-token window and C4 top-512 / C128 slots through
        # their block tables; the C128 list is max_model_len 1M / 128 = 8192 slots, up to 300 visible
        # (bytes count the mean, 150; about 1.5% of windows reach before position 0: not counted).
        Case("sparse_attn_cached", f"decode T=64 H={H} W=128 + C4 512, fp8",
             lambda: kc.sparse_attn_cached_args(64, H, d, 128, 512, FP8_MAIN, BF16, **decode),
             kc.sparse_attn_cached_bytes(64, H, d, 640, 640, FP8_MAIN.entry_bytes, BF16)),
        Case("sparse_attn_cached", f"decode T=64 H={H} W=128 + C4 512, bf16",
             lambda: kc.sparse_attn_cached_args(64, H, d, 128, 512, None, BF16, **decode),
             kc.sparse_attn_cached_bytes(64, H, d, 640, 640, 2 * d, BF16)),
        Case("sparse_attn_cached", f"decode T=64 H={H} W=128 + C128 8192, fp8",
             lambda: kc.sparse_attn_cached_args(64, H, d, 128, 8192, FP8_MAIN, BF16, **c128),
             kc.sparse_attn_cached_bytes(64, H, d, 128 + 8192, 128 + 150, FP8_MAIN.entry_bytes, BF16)),
        Case("mhc_pre", "decode T=1 n=4 D=4096", lambda: kc.mhc_pre_args(1, 4, 4096, BF16),
             kc.mhc_pre_bytes(1, 4, 4096, BF16)),
        Case("mhc_pre", "batch T=64 n=4 D=4096", lambda: kc.mhc_pre_args(64, 4, 4096, BF16),
             kc.mhc_pre_bytes(64, 4, 4096, BF16)),
        Case("mhc_pre", "prefill T=4096 n=4 D=4096", lambda: kc.mhc_pre_args(4096, 4, 4096, BF16),
             kc.mhc_pre_bytes(4096, 4, 4096, BF16)),
        Case("mhc_post", "batch T=64 n=4 D=4096", lambda: kc.mhc_post_args(64, 4, 4096, BF16),
             kc.mhc_post_bytes(64, 4, 4096, BF16)),
        Case("mhc_post", "prefill T=4096 n=4 D=4096", lambda: kc.mhc_post_args(4096, 4, 4096, BF16),
             kc.mhc_post_bytes(4096, 4, 4096, BF16)),
        Case("pool_state_windows", "C4 prefill N=1024 S=8 d=512",
             lambda: kc.pool_windows_args(1024, 4, 512, True, E=64), kc.compress_bytes(1024, 8, 512, torch.float32)),
        Case("pool_state_windows", "indexer prefill N=1024 S=8 d=128",
             lambda: kc.pool_windows_args(1024, 4, 128, True, E=64), kc.compress_bytes(1024, 8, 128, torch.float32)),
        Case("pool_state_windows", "C128 prefill N=32 S=128 d=512",
             lambda: kc.pool_windows_args(32, 128, 512, False, E=64), kc.compress_bytes(32, 128, 512, torch.float32)),
        Case("indexer_topk", "decode Tq=64 N=16384 H=64 di=128 top-512",
             lambda: kc.indexer_args([16384] * 64, 16384, 64, 128, 512, BF16),
             kc.indexer_bytes(64, 64, 128, 16384, 512, BF16)),
        Case("indexer_topk", "prefill Tq=4096 N=1024 (causal) top-512",
             lambda: kc.indexer_args([(p + 1) // 4 for p in range(4096)], 1024, 64, 128, 512, BF16),
             kc.indexer_bytes(4096, 64, 128, 1024, 512, BF16)),
        Case("route", "decode T=64 E=256 k=6", lambda: kc.route_args(64, 256, 6), kc.route_bytes(64, 256, 6)),
        Case("route", "prefill T=4096 E=256 k=6", lambda: kc.route_args(4096, 256, 6), kc.route_bytes(4096, 256, 6)),
        Case("route", "hash T=4096 E=256 k=6", lambda: kc.route_args(4096, 256, 6, hashed=True),
             kc.route_bytes(4096, 256, 6)),
        Case("apply_rope_tail", "q T=4096 H=64 d=512 r=64", lambda: kc.rope_args(4096, (64,), 512, 64, BF16),
             kc.rope_bytes(4096, 64, 512, BF16)),
        Case("apply_rope_tail", "kv T=4096 d=512 r=64", lambda: kc.rope_args(4096, (), 512, 64, BF16),
             kc.rope_bytes(4096, 1, 512, BF16)),
        Case("norm_rope_tail", "q T=4096 H=64 d=512 r=64", lambda: kc.norm_rope_args(4096, (64,), 512, 64, BF16),
             kc.rope_bytes(4096, 64, 512, BF16)),
        Case("rms_norm", "hidden decode T=64 D=4096", lambda: kc.rms_norm_args((64,), 4096, dtype=BF16),
             kc.rms_norm_bytes(64, 4096, BF16)),
        Case("rms_norm", "hidden prefill T=8192 D=4096", lambda: kc.rms_norm_args((8192,), 4096, dtype=BF16),
             kc.rms_norm_bytes(8192, 4096, BF16)),
        Case("rms_norm", "q latent prefill T=8192 D=1024", lambda: kc.rms_norm_args((8192,), 1024, dtype=BF16),
             kc.rms_norm_bytes(8192, 1024, BF16)),
    ]
    return rows


def implementations(op: str) -> tuple[Callable, Callable]:
    """(kernel, reference) of an op."""
    from csrc_triton import (compressor, compressor_ref, indexer_ref, indexer_topk, mhc, mhc_ref, moe_mxfp4,
                             moe_mxfp4_ref, norm, norm_ref, out_proj, out_proj_ref, rope, rope_ref, routing,
                             routing_ref, sparse_attn, sparse_attn_ref)

    return {
        "rope_out_proj": (out_proj.rope_out_proj, out_proj_ref.rope_out_proj),
        "moe_experts_mxfp4": (moe_mxfp4.moe_experts_mxfp4, moe_mxfp4_ref.moe_experts_mxfp4),
        "moe_experts_fp8": (moe_mxfp4.moe_experts_fp8, moe_mxfp4_ref.moe_experts_fp8),
        "sparse_attn": (sparse_attn.sparse_attn, sparse_attn_ref.sparse_attn),
        "sparse_attn_cached": (sparse_attn.sparse_attn_cached, sparse_attn_ref.sparse_attn_cached),
        "mhc_pre": (mhc.mhc_pre, mhc_ref.mhc_pre),
        "mhc_post": (mhc.mhc_post, mhc_ref.mhc_post),
        "pool_state_windows": (compressor.pool_state_windows, compressor_ref.pool_state_windows),
        "indexer_topk": (indexer_topk.indexer_topk, indexer_ref.indexer_topk),
        "route": (routing.route, routing_ref.route),
        "apply_rope_tail": (rope.apply_rope_tail, rope_ref.apply_rope_tail),
        "norm_rope_tail": (rope.norm_rope_tail, rope_ref.norm_rope_tail),
        "rms_norm": (norm.rms_norm, norm_ref.rms_norm),
    }[op]


def alternatives(op: str, inputs: tuple) -> dict[str, Callable]:
    """The other GPU implementations of an op the model can run (``ops.OUT_PROJ``, ``ops.MOE_BACKEND``),
    bound to this case's inputs, built as the model builds them (call under vLLM's current config)."""
    if op == "rope_out_proj":  # inverse-RoPE kernel, then vLLM's block-FP8 GEMM per group (grouped);
        # our de-rotating quantiser, then DeepGEMM's grouped GEMM (einsum; auto's above 1,024 tokens)
        from csrc_triton.out_proj import default_tiles, rope_out_proj, rope_quant_fp8
        from vllm_dsv4.ops.vllm_kernels import grouped_fp8_gemm
        from vllm_dsv4.model.attention import grouped_out_proj
        from vllm_dsv4.model.layers import Linear

        o, positions, inv_freq, weight, weight_scale, groups = inputs
        linear = Linear(weight.shape[1], weight.shape[0]).to(o.device)
        linear.hold_fp8(groups)
        linear.weight.data.copy_(weight)
        linear.weight_scale.data.copy_(weight_scale)
        linear.finish_loading("grouped")
        einsum = grouped_fp8_gemm(weight.clone(), weight_scale.clone(), groups)

        # other tile shapes of the fused kernel, named mBLOCK_M nBLOCK_N wWARPS sSTAGES [kSPLIT_K]
        T, chosen = o.shape[0], default_tiles(o.shape[0])
        sweep = ([dict(chosen, BLOCK_N=n, num_warps=w, num_stages=st) for n, w, st in
                  ((32, 4, 4), (64, 4, 4), (64, 8, 4), (128, 4, 4), (128, 8, 4), (128, 8, 6), (256, 8, 4))]
                 + [dict(chosen, SPLIT_K=sk) for sk in (1, 2, 4, 8)] if T <= 64 else
                 [dict(chosen, BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=st) for m, n, w, st in
                  ((64, 128, 4, 4), (128, 256, 8, 3), (256, 128, 8, 3))])
        tiled = {f"m{t['BLOCK_M']}n{t['BLOCK_N']}w{t['num_warps']}s{t['num_stages']}"
                 + (f"k{t['SPLIT_K']}" if "SPLIT_K" in t else ""):
                 (lambda t=t: rope_out_proj(o, positions, inv_freq, weight, weight_scale, groups, tiles=t))
                 for t in sweep if t != chosen}
        return {"grouped": lambda: grouped_out_proj(o, positions, inv_freq, linear, groups),
                "einsum": lambda: einsum(*rope_quant_fp8(o, positions, inv_freq, groups))} | tiled
    if op == "moe_experts_mxfp4":  # vLLM's Marlin MXFP4 MoE, the weights repacked once
        from vllm_dsv4.ops import vllm_kernels

        x, weights, ids, w13, w13_scale, w2, w2_scale, limit, narrow = inputs
        from csrc_triton.moe_mxfp4 import _config, moe_experts_mxfp4

        marlin = vllm_kernels.marlin_mxfp4_experts(w13.clone(), w13_scale.clone(), w2.clone(), w2_scale.clone(), limit)
        # other tiles of our kernel, named mBLOCK_M nBLOCK_N kBLOCK_K wWARPS sSTAGES: at decode sizes
        # the 4-warp 32-column tile (the former default), wider, 1-warp, deeper-K and deeper-pipeline
        # (the decode's K loop issues ~3.4 SASS instructions per weight: more loads in flight may hide more),
        # and shallower ones (W13's 4 stages take 38 KB of shared memory, 5 programs per SM: fewer stages or
        # a 64-wide K step leave room for more); for batches the default tile with x gathered into the K
        # order in the kernel (the default permutes x once per call, X_IN_K_ORDER), 8 warps and 128-row blocks
        chosen = _config(ids.numel(), w13.shape[0], x.dtype)
        shapes = (((16, 32, 128, 4, 4), (16, 64, 128, 4, 4), (16, 128, 128, 2, 4), (16, 64, 128, 1, 4),
                   (16, 64, 256, 2, 3), (16, 64, 128, 2, 6), (16, 64, 128, 2, 3), (16, 64, 64, 2, 4))
                  if chosen["BLOCK_M"] == 16 else
                  ((64, 64, 64, 4, 3), (64, 64, 64, 8, 3), (64, 128, 64, 8, 3), (128, 64, 64, 8, 3)))
        sweep = [dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=kk, num_warps=w, num_stages=st) for m, n, kk, w, st in shapes]
        tiled = {f"m{c['BLOCK_M']}n{c['BLOCK_N']}k{c['BLOCK_K']}w{c['num_warps']}s{c['num_stages']}":
                 (lambda c=c: moe_experts_mxfp4(x, weights, ids, w13, w13_scale, w2, w2_scale, limit, narrow, config=c))
                 for c in sweep if c != chosen}
        return {"marlin": lambda: marlin(x, weights, ids)} | tiled
    return {}


def max_abs_diff(op: str, a, b) -> float:
    """Largest |kernel - reference| over the (tuple of) float outputs; index outputs are skipped and
    routing weights are compared in expert-id order (the top-k slot order is unspecified)."""
    if op == "route":
        a, b = (w.gather(1, i.argsort(1)) for w, i in (a, b))
    a, b = (a, b) if isinstance(a, tuple) else ((a,), (b,))
    diffs = [(x.double() - y.double()).abs().max().item() for x, y in zip(a, b) if x.is_floating_point() and x.numel()]
    return max(diffs, default=0.0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--op", help="only this op (e.g. sparse_attn)")
    parser.add_argument("--rep", type=int, default=200, help="do_bench repetition time, ms")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_kernels: no CUDA, skipped")
        return
    from triton.testing import do_bench, do_bench_cudagraph

    import tempfile

    from vllm.config import set_current_vllm_config

    from tests.conftest import load_make_checkpoint
    from tests.csrc_triton.kernel_cases import vllm_config_for

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; % of {HBM_PEAK_BYTES_PER_S / 1e12:.1f} TB/s")
    print("µs: replayed from a CUDA graph (as decode steps run; no Python launch cost), 'eager' where the op")
    print("cannot be captured (the references sync); x ref: the reference's eager time over this one")
    header = f"{'op':<18} {'case':<46} {'impl':<12} {'µs':>9} {'timed':>6} {'GB/s':>8} {'%peak':>6} {'x ref':>6}  max|diff|"
    print(header)
    print("-" * len(header))
    with tempfile.TemporaryDirectory() as tmp:  # vLLM's kernel choice reads a DeepSeek-V4 model config
        config = vllm_config_for(load_make_checkpoint().make_checkpoint(tmp, "tiny", quantized=True))
        with set_current_vllm_config(config):
            for case in cases():
                if args.op and case.op != args.op:
                    continue
                run_case(case, args.rep, do_bench, do_bench_cudagraph)


def run_case(case: Case, rep: int, do_bench, do_bench_cudagraph) -> None:
    """Time the kernel, the reference and any alternative on one case's inputs; print a row each.
    Eager timing of a small op measures Python's launch cost (tens of µs per launch), which CUDA-graph
    decode does not pay: every implementation but the reference is timed from a graph where it can be."""
    kernel, ref = implementations(case.op)
    inputs = case.build()
    expected = ref(*inputs)
    impls = {"triton": lambda: kernel(*inputs), "ref": lambda: ref(*inputs)} | alternatives(case.op, inputs)
    diffs, times, how = {}, {}, {}
    for name, f in impls.items():
        try:
            diffs[name] = None if name == "ref" else max_abs_diff(case.op, f(), expected)
            how[name] = "eager"
            if name != "ref":
                try:
                    times[name], how[name] = do_bench_cudagraph(f, rep=rep, return_mode="median"), "graph"
                except Exception:  # a host sync inside: not capturable
                    torch.cuda.synchronize()
            if how[name] == "eager":
                times[name] = do_bench(f, warmup=25, rep=rep, return_mode="median")
        except Exception as e:  # e.g. a swept tile shape that does not fit shared memory
            print(f"{case.op:<18} {case.label:<46} {name:<12} failed: {type(e).__name__}: {str(e)[:80]}")
    for name, ms in times.items():
        gbs = case.bytes_moved / (ms * 1e-3) / 1e9
        print(f"{case.op:<18} {case.label:<46} {name:<12} {ms * 1e3:9.1f} {how[name]:>6} {gbs:8.0f} "
              f"{100 * gbs * 1e9 / HBM_PEAK_BYTES_PER_S:5.1f}% {times['ref'] / ms:6.2f}"
              + (f"  {diffs[name]:.2e}" if diffs[name] is not None else ""))
    del inputs, expected
    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
