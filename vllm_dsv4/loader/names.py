"""Official checkpoint name -> our parameter name. Modules mirror the official tree, so only the
choices we made differently appear here, one row each."""

from __future__ import annotations

import re

# (pattern over the official name, replacement giving our parameter name, row slice selector)
# The selector names which part of a stacked parameter the tensor fills: None = whole parameter,
# ("expert", half) = experts.w13[e][half] or experts.w2[e].
RENAMES: tuple[tuple[re.Pattern, str], ...] = (
    (re.compile(r"^hc_head_(fn|base|scale)$"), r"hc_head.\1"),
    (re.compile(r"^(layers\.\d+)\.hc_(attn|ffn)_(fn|base|scale)$"), r"\1.hc_\2.\3"),
)
# Routed experts are stacked: w1 -> w13[e, :I], w3 -> w13[e, I:], w2 -> w2[e].
EXPERT = re.compile(r"^(layers\.\d+\.ffn\.experts)\.(\d+)\.(w1|w2|w3)\.weight$")
EXPERT_TARGET = {"w1": ("w13", 0), "w3": ("w13", 1), "w2": ("w2", None)}


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
