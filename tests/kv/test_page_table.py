"""Cache page sizes: vLLM's spec arithmetic, hand-computed figures and the table in ARCHITECTURE.md agree."""

import importlib.util
from pathlib import Path

import pytest
import torch

from vllm_dsv4.config import Dsv4Config, LayerKind
from vllm_dsv4.kv.layout import layer_components
from vllm_dsv4.kv.spec import component_spec

ROOT = Path(__file__).resolve().parents[2]


def load_script(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def flash_cfg():
    return Dsv4Config.from_dict(load_script("make_checkpoint").make_config("flash", num_layers=43))


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("kind", list(LayerKind))
def test_vllm_spec_page_size_equals_layout(flash_cfg, kind, fp8):
    for comp in layer_components(flash_cfg, kind, torch.bfloat16, 256, fp8).values():
        assert component_spec(comp).page_size_bytes == comp.page_bytes, comp.name


def test_flash_pages_match_hand_computed_values(flash_cfg):
    """bf16 512-wide entries; 64 C4 entries / 2 C128 entries per 256-token block; fp32 states."""
    c4 = layer_components(flash_cfg, LayerKind.C4, torch.bfloat16, 256)
    c128 = layer_components(flash_cfg, LayerKind.C128, torch.bfloat16, 256)
    assert c4["swa"].page_bytes == 64 * 512 * 2
    assert c4["c4"].page_bytes == 64 * 512 * 2
    assert c4["indexer"].page_bytes == 64 * 128 * 2
    assert c4["c4_state"].page_bytes == 4 * (2 * 2 * 512) * 4
    assert c4["indexer_state"].page_bytes == 4 * (2 * 2 * 128) * 4
    assert c128["c128"].page_bytes == 2 * 512 * 2
    assert c128["c128_state"].page_bytes == 8 * (2 * 512) * 4
    assert set(layer_components(flash_cfg, LayerKind.SWA, torch.bfloat16, 256)) == {"swa"}


def test_architecture_doc_embeds_current_table():
    doc = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    table = load_script("page_table").render()
    assert table in doc, "docs/ARCHITECTURE.md page table is stale: rerun scripts/page_table.py"
    # 21 C4 layers x (1024 + 256) / 4 + 20 C128 layers x 1024 / 128 (docs/MODEL.md §9.1's bf16 figure)
    assert "6,880.0" in table


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_dspark_stage_cache_is_a_window_one_token_longer(fp8):
    """A DSpark stage's cache holds swa's entries by position; its block's first query, at the anchor p,
    reads the sliding_window positions before p, so vLLM keeps (and a resume at p reloads) one more."""
    from vllm_dsv4.kv.layout import component_of_layer, dspark_component

    cfg = Dsv4Config.from_dict(load_script("make_checkpoint").make_config("flash-0731", num_layers=43))
    comp = dspark_component(cfg, torch.bfloat16, fp8)
    swa = layer_components(cfg, LayerKind.SWA, torch.bfloat16, 256, fp8)["swa"]
    assert (comp.entry_bytes, comp.block_tokens, comp.window_tokens) == (swa.entry_bytes, swa.block_tokens, 129)
    assert component_spec(comp).page_size_bytes == comp.page_bytes == swa.page_bytes
    assert component_spec(comp).sliding_window == 129
    assert [comp.resume_start(p) for p in (0, 128, 129, 1000)] == [0, 0, 1, 872]
    assert component_of_layer(cfg, "mtp.2.attn.dspark_cache", 256).name == "dspark"
