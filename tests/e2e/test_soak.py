"""A short soak (scripts/soak.py): 8 clients, a kv_both store under a small budget vandalised meanwhile,
chat, tools, completions, streams, dropped streams and malformed requests; the pass conditions are the
script's (same greedy tokens as a server without the store, 4xx for the malformed, no engine restart,
the budget held, RSS and KV usage back after the load)."""

import json

import pytest

from tests.conftest import REPO_ROOT, load_module_by_path

pytestmark = pytest.mark.e2e


def test_a_short_soak(tiny_ckpt, tmp_path):
    soak = load_module_by_path(REPO_ROOT / "scripts" / "soak.py")
    figures = soak.soak(soak.parse_args(["--model", str(tiny_ckpt), "--requests", "48", "--seed", "1",
                                         "--settle-s", "3", "--work", str(tmp_path)]))
    assert figures["passed"], json.dumps(figures, indent=1)
    assert figures["external_hit_tokens"] > 0 and sum(figures["vandal_actions"].values()) > 0, json.dumps(figures)
