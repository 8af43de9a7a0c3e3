"""Official checkpoint name -> our parameter name. Modules mirror the official tree, so only the
choices we made differently appear here, one row each."""

from __future__ import annotations

import re

RENAMES: tuple[tuple[re.Pattern, str], ...] = (
    (re.compile(r"^hc_head_(fn|base|scale)$"), r"hc_head.\1"),
    (re.compile(r"^(layers\.\d+)\.hc_(attn|ffn)_(fn|base|scale)$"), r"\1.hc_\2.\3"),
)
# Routed experts are stacked: w1 -> w13[e, :I], w3 -> w13[e, I:], w2 -> w2[e].
EXPERT = re.compile(r"^(layers\.\d+\.ffn\.experts)\.(\d+)\.(w1|w2|w3)\.weight$")
EXPERT_TARGET = {"w1": ("w13", 0), "w3": ("w13", 1), "w2": ("w2", None)}


# Tensors split across tensor-parallel ranks, and along which dim (model/parallel.py says why).
SHARDED_DIM: tuple[tuple[re.Pattern, int], ...] = (
    (re.compile(r"\.attn\.(wq_b\.weight|attn_sink|wo_a\.weight)$"), 0),
    (re.compile(r"\.attn\.wo_b\.weight$"), 1),
    (re.compile(r"\.shared_experts\.(w1|w3)\.weight$"), 0),
    (re.compile(r"\.shared_experts\.w2\.weight$"), 1),
)


def sharded_dim(name: str) -> int | None:
    return next((dim for pattern, dim in SHARDED_DIM if pattern.search(name)), None)


def param_target(name: str) -> tuple[str, int | None, int | None]:
    """(our parameter name, expert index or None, half of a w13 stack or None)."""
    m = EXPERT.match(name)
    if m:
        target, half = EXPERT_TARGET[m.group(3)]
        return f"{m.group(1)}.{target}", int(m.group(2)), half
    for pattern, repl in RENAMES:
        if pattern.match(name):
            return pattern.sub(repl, name), None, None
    return name, None, None
