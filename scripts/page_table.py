"""Prints the KV page-size tables that docs/ARCHITECTURE.md embeds (tests/kv/test_page_table.py checks)."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from make_checkpoint import make_config  # noqa: E402

from vllm_dsv4.config import Dsv4Config  # noqa: E402
from vllm_dsv4.kv.layout import page_size_table  # noqa: E402

# (title, preset, KV dtype, layers, FP8 entries): without --kv-cache-dtype fp8, KV is in the model dtype.
TABLES = (
    ("V4-Flash-0731 (43 layers, 3 DSpark stages), FP8 KV (`--kv-cache-dtype fp8`)", "flash-0731", torch.bfloat16,
     43, True),
    ("V4-Flash (43 layers), bf16 KV", "flash", torch.bfloat16, 43, False),
    ("tiny preset, fp32 KV (the CI tests)", "tiny", torch.float32, None, False),
)


def render() -> str:
    parts = []
    for title, preset, dtype, layers, fp8 in TABLES:
        cfg = Dsv4Config.from_dict(make_config(preset, num_layers=layers))
        parts.append(f"**{title}**\n\n{page_size_table(cfg, dtype, fp8=fp8)}")
    return "\n\n".join(parts)


if __name__ == "__main__":
    print(render())
