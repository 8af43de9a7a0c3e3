"""The fastest a checkpoint's decode and prefill steps can run on a card: HBM and tensor-core floors.

    python scripts/floors.py --model CKPT                   # the checkpoint's config.json, on an H200
    python scripts/floors.py --preset flash --card h100     # a make_checkpoint.py preset's config
    python scripts/floors.py --model CKPT --json            # for scripts/bench_gpu.py --report --floors

Decode (one token per request, B requests at a context of ``--context`` tokens, FP8 KV): the bytes a
step must read, over the card's measured copy bandwidth:
  * routed experts: each MoE layer reads every expert some request picked. With top-k of E experts
    picked near uniformly (random weights route so; trained routers skew, which lowers it), the expected
    number of distinct experts at batch B is E (1 - (1 - k/E)^B), each its MXFP4 codes and scales;
  * every other weight of a layer once (FP8 linears with their scales, bf16 compressors, router, mHC),
    the head once, the embedding's B rows;
  * per request and layer, the KV entries attention reads: the window (``sliding_window`` entries),
    C4's top ``index_topk`` entries plus every indexer key scored, every C128 entry; the compressor
    states' open windows.
Prefill (one prompt of N tokens, one output token): the matrix FLOPs over the tensor cores' rates: FP8
linears and the indexer's scores at the FP8 rate, MXFP4 experts (no FP4 tensor cores on Hopper: W4A16)
and bf16 weights, attention, at the bf16 rate; the head on the last token only. Causal: query p attends
min(p + 1, window) window keys, min(p // 4, index_topk) C4 entries and p // 128 C128 entries, and the
indexer scores p // 4 keys. A floor is what no implementation beats; what a kernel reaches is a share of it.

Ceilings: measured on the H200 and H100 machines the benchmarks run on (a device-to-device copy, bytes
read + written; an 8192^3 bf16 matrix product on random data), not the datasheets'. The FP8 rate is
taken as twice the bf16 one (the datasheets' ratio; not measured).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vllm_dsv4.config import Dsv4Config, LayerKind  # noqa: E402
from vllm_dsv4.kv.layout import layer_components  # noqa: E402
from vllm_dsv4.loader.checkpoint import layer_tensors, top_level_tensors  # noqa: E402

CARDS = {  # bytes/s, bf16 FLOP/s, as measured (module doc)
    "h200": (4.3e12, 790e12),
    "h100": (3.0e12, 798e12),
}
FP8_OVER_BF16 = 2.0
DECODE_BATCHES = (1, 16, 64)
PREFILL_LENS = (8192, 32768)
CONTEXT = 1024 + 64  # the decode benchmark's 1k-token prompts, half-way through their 128 output tokens


@dataclass(frozen=True)
class Card:
    bandwidth: float  # bytes / s
    bf16_flops: float  # FLOP / s

    @property
    def fp8_flops(self) -> float:
        return FP8_OVER_BF16 * self.bf16_flops


def _bytes(spec) -> int:
    n = 1
    for s in spec.shape:
        n *= s
    return n * spec.dtype.itemsize


def _is_routed_expert(name: str) -> bool:
    return ".ffn.experts." in name


def expert_bytes(cfg: Dsv4Config) -> int:
    """One routed expert's stored bytes (w1, w2, w3 with their scales)."""
    return sum(_bytes(s) for n, s in layer_tensors(cfg, 0).items() if ".ffn.experts.0." in n)


def expected_distinct_experts(cfg: Dsv4Config, batch: int) -> float:
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    return e * (1 - (1 - k / e) ** batch)


def kv_bytes_per_request(cfg: Dsv4Config, kind: LayerKind, context: int) -> int:
    """The cache bytes one decode query of a layer of ``kind`` reads (FP8 KV)."""
    comps = layer_components(cfg, kind, None, 256, fp8=True)
    total = min(context, cfg.sliding_window) * comps["swa"].entry_bytes
    if kind is LayerKind.C4:
        entries = context // 4
        total += min(entries, cfg.index_topk) * comps["c4"].entry_bytes + entries * comps["indexer"].entry_bytes
    elif kind is LayerKind.C128:
        total += context // 128 * comps["c128"].entry_bytes
    # the compressor states' open windows
    total += sum(c.window_tokens * c.entry_bytes for n, c in comps.items() if n.endswith("_state"))
    return total


def decode_bytes(cfg: Dsv4Config, batch: int, context: int = CONTEXT) -> dict[str, float]:
    """Bytes one decode step of ``batch`` requests reads, by part."""
    per_expert, distinct = expert_bytes(cfg), expected_distinct_experts(cfg, batch)
    parts = dict(experts=0.0, other_weights=0.0, head=0.0, kv=0.0)
    for layer in range(cfg.num_hidden_layers):
        parts["experts"] += distinct * per_expert
        parts["other_weights"] += sum(_bytes(s) for n, s in layer_tensors(cfg, layer).items()
                                      if not _is_routed_expert(n) and not n.endswith("tid2eid"))
        parts["kv"] += batch * kv_bytes_per_request(cfg, cfg.layer_kind(layer), context)
    top = top_level_tensors(cfg)
    parts["head"] = _bytes(top["head.weight"])
    parts["other_weights"] += batch * cfg.hidden_size * 2  # the embedding's rows
    parts["other_weights"] += sum(_bytes(s) for n, s in top.items() if n not in ("head.weight", "embed.weight"))
    return parts


def _linear_flops(cfg: Dsv4Config, layer: int) -> tuple[float, float]:
    """(FP8, bf16) FLOPs per token of a layer's linears other than the routed experts (2 per weight)."""
    fp8 = bf16 = 0.0
    for name, spec in layer_tensors(cfg, layer).items():
        if not name.endswith(".weight") or len(spec.shape) != 2 or _is_routed_expert(name):
            continue
        if spec.dtype.itemsize == 1:  # FP8 codes
            fp8 += 2 * spec.shape[0] * spec.shape[1]
        elif "norm" not in name:
            bf16 += 2 * spec.shape[0] * spec.shape[1]
    return fp8, bf16


def prefill_flops(cfg: Dsv4Config, tokens: int) -> dict[str, float]:
    """(FP8 FLOPs, bf16 FLOPs) of one prompt of ``tokens`` tokens, by part."""
    d, h, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    window = cfg.sliding_window
    # sum over p < N of min(p + 1, w), of min(p // r, cap) and of p // r, in closed form enough for floors
    window_keys = sum(min(p + 1, window) for p in range(tokens))
    parts = dict(fp8_linears=0.0, bf16_linears=0.0, experts=0.0, attention=0.0, indexer=0.0, head=0.0)
    per_token_expert = cfg.num_experts_per_tok * 3 * 2 * d * cfg.moe_intermediate_size
    for layer in range(cfg.num_hidden_layers):
        fp8, bf16 = _linear_flops(cfg, layer)
        parts["fp8_linears"] += fp8 * tokens
        parts["bf16_linears"] += bf16 * tokens
        parts["experts"] += per_token_expert * tokens
        kind, keys = cfg.layer_kind(layer), window_keys
        if kind is LayerKind.C4:
            keys += sum(min(p // 4, cfg.index_topk) for p in range(tokens))
            parts["indexer"] += 2 * cfg.index_n_heads * cfg.index_head_dim * sum(p // 4 for p in range(tokens))
        elif kind is LayerKind.C128:
            keys += sum(p // 128 for p in range(tokens))
        parts["attention"] += 2 * h * (hd + hd) * keys  # scores and values, 2 FLOPs per multiply-add
    parts["head"] = 2 * cfg.vocab_size * d
    return parts


def floors(cfg: Dsv4Config, card: Card, context: int = CONTEXT, batches=DECODE_BATCHES,
           lens=PREFILL_LENS) -> dict:
    """{"decode": {B: {...}}, "prefill": {N: {...}}}: bytes or FLOPs by part, the floor in seconds
    and the tokens per second it allows."""
    out = {"decode": {}, "prefill": {}}
    for b in batches:
        parts = decode_bytes(cfg, b, context)
        seconds = sum(parts.values()) / card.bandwidth
        out["decode"][b] = dict(parts, bytes=sum(parts.values()), floor_s=seconds, tok_s=b / seconds,
                                distinct_experts=expected_distinct_experts(cfg, b))
    for n in lens:
        parts = prefill_flops(cfg, n)
        fp8 = parts["fp8_linears"] + parts["indexer"]
        seconds = fp8 / card.fp8_flops + (sum(parts.values()) - fp8) / card.bf16_flops
        out["prefill"][n] = dict(parts, floor_s=seconds, tok_s=n / seconds)
    return out


def table(result: dict, card: str) -> str:
    lines = [f"HBM floors of a decode step ({card}; GB read by part, ms per step, output tok/s at the floor)",
             "| batch | distinct experts / layer | experts | other weights | head | KV | total | ms | tok/s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for b, r in result["decode"].items():
        gb = lambda k: f"{r[k] / 1e9:.3f}"  # noqa: E731
        lines.append(f"| {b} | {r['distinct_experts']:.1f} | {gb('experts')} | {gb('other_weights')} | {gb('head')} "
                     f"| {gb('kv')} | {gb('bytes')} | {r['floor_s'] * 1e3:.3f} | {r['tok_s']:,.0f} |")
    lines += ["", f"Tensor-core floors of a prefill ({card}; TFLOP by part, ms, tok/s at the floor)",
              "| tokens | FP8 linears | bf16 linears | experts | attention | indexer | ms | tok/s |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for n, r in result["prefill"].items():
        tf = lambda k: f"{r[k] / 1e12:.2f}"  # noqa: E731
        lines.append(f"| {n} | {tf('fp8_linears')} | {tf('bf16_linears')} | {tf('experts')} | {tf('attention')} "
                     f"| {tf('indexer')} | {r['floor_s'] * 1e3:.2f} | {r['tok_s']:,.0f} |")
    return "\n".join(lines)


def load_config(model: str | None, preset: str | None) -> Dsv4Config:
    if model:
        return Dsv4Config.from_pretrained(model)
    from scripts.make_checkpoint import make_config

    return Dsv4Config.from_dict(make_config(preset))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a checkpoint directory (its config.json)")
    src.add_argument("--preset", help="a scripts/make_checkpoint.py preset (flash: 6 layers)")
    ap.add_argument("--card", choices=sorted(CARDS), default="h200")
    ap.add_argument("--context", type=int, default=CONTEXT, help="decode context length (tokens)")
    ap.add_argument("--json", action="store_true", help="print the floors as JSON")
    args = ap.parse_args()
    result = floors(load_config(args.model, args.preset), Card(*CARDS[args.card]), args.context)
    print(json.dumps(result, indent=1) if args.json else table(result, args.card))
    return 0


if __name__ == "__main__":
    sys.exit(main())
