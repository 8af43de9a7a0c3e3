"""Official checkpoint name -> our parameter name. Modules mirror the official tree, so only the
choices we made differently appear here, one row each."""

from __future__ import annotations

import re
from typing import NamedTuple

# A block is ``layers.N`` or an MTP module ``mtp.K`` (a block with its own head mixer, §7).
RENAMES: tuple[tuple[re.Pattern, str], ...] = (
    (re.compile(r"^((?:mtp\.\d+\.)?)hc_head_(fn|base|scale)$"), r"\1hc_head.\2"),
    (re.compile(r"^((?:layers|mtp)\.\d+)\.hc_(attn|ffn)_(fn|base|scale)$"), r"\1.hc_\2.\3"),
)
# Routed experts are stacked: w1 -> w13[e, :I], w3 -> w13[e, I:], w2 -> w2[e].
EXPERT = re.compile(r"^((?:layers|mtp)\.\d+\.ffn\.experts)\.(\d+)\.(w1|w2|w3)\.weight$")
# Linears of one module that read the same input are one weight, the official weights' rows stacked in
# this order: one GEMM per step instead of several (and in FP8 one activation quantisation).
# module -> (our merged linear, the official linears it stacks)
MERGED = {
    "attn": ("wqkv_a", ("wq_a", "wkv")),
    "compressor": ("wkv_gate", ("wkv", "wgate")),
    "shared_experts": ("w13", ("w1", "w3")),
}
MERGED_MEMBER = re.compile(r"^(.*\.(attn|compressor|shared_experts))\.(\w+)\.weight$")


class Target(NamedTuple):
    """Where an official weight goes: ``param``, at ``expert`` of a stacked parameter (or None), in
    the rows of member ``part`` of ``members`` (the official weights whose rows ``param`` stacks, in
    order; () when it holds one weight)."""

    param: str
    expert: int | None = None
    part: int | None = None
    members: tuple[str, ...] = ()


# Tensors (official, and our merged parameters) split across tensor-parallel ranks, and along which dim
# (model/parallel.py says why).
SHARDED_DIM: tuple[tuple[re.Pattern, int], ...] = (
    (re.compile(r"\.attn\.(wq_b\.weight|attn_sink|wo_a\.weight)$"), 0),
    (re.compile(r"\.attn\.wo_b\.weight$"), 1),
    (re.compile(r"\.shared_experts\.(w1|w3|w13)\.weight$"), 0),  # w13: our merged w1 | w3, each cut alike
    (re.compile(r"\.shared_experts\.w2\.weight$"), 1),
)


def sharded_dim(name: str) -> int | None:
    return next((dim for pattern, dim in SHARDED_DIM if pattern.search(name)), None)


def param_target(name: str) -> Target:
    """Our parameter for official tensor ``name`` (a weight; a scale follows its weight)."""
    m = EXPERT.match(name)
    if m:
        stack, expert, linear = m.group(1), int(m.group(2)), m.group(3)
        if linear == "w2":
            return Target(f"{stack}.w2", expert)
        members = tuple(f"{stack}.{expert}.{w}.weight" for w in ("w1", "w3"))
        return Target(f"{stack}.w13", expert, members.index(name), members)
    m = MERGED_MEMBER.match(name)
    if m:
        module, (merged, linears) = m.group(1), MERGED[m.group(2)]
        if m.group(3) in linears:
            members = tuple(f"{module}.{w}.weight" for w in linears)
            return Target(f"{module}.{merged}.weight", None, members.index(name), members)
    for pattern, repl in RENAMES:
        if pattern.match(name):
            return Target(pattern.sub(repl, name))
    return Target(name)
