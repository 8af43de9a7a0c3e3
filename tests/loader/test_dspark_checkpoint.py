"""DSpark checkpoints (V4-Flash-0731, V4-Pro-0813): the stage tables against the release, the kind of a
checkpoint from its config and index, and a named error for every malformed DSpark tensor or config key."""

from __future__ import annotations

import json
import re

import pytest
import torch

from tests.loader.test_checkpoint import load_all, problems_of, rewrite
from tests.loader.test_load import empty_params, stream
from tests.oracle.hf_oracle import oracle_dequant_fp8, oracle_dequant_mxfp4
from vllm_dsv4.config import ConfigError, Dsv4Config
from vllm_dsv4.loader.checkpoint import Checkpoint, TensorSpec, draft_blocks, expected_tensors, validate
from vllm_dsv4.loader.drafts import check_draft_method, draft_of, tensor_names
from vllm_dsv4.loader.kinds import kind_of
from vllm_dsv4.loader.load import load_official_weights

E4M3, E8M0, BF16, F32, I8 = torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.bfloat16, torch.float32, torch.int8


def method_of(path) -> str | None:
    return draft_of(json.loads((path / "config.json").read_text()), tensor_names(path)).method


def test_flash_0731_stages_match_the_release(make_checkpoint_module):
    """docs/MODEL.md §16.2: 1,568 / 1,565 / 1,572 tensors per stage (1,536 of them
    routed-expert weights and scales), the DSpark-only tensors' shapes and dtypes."""
    cfg = Dsv4Config.from_dict(make_checkpoint_module.make_config("flash-0731", num_layers=43))
    assert cfg.dspark.target_layer_ids == (40, 41, 42) and len(cfg.compress_ratios) == 46
    table = expected_tensors(cfg)
    stages = draft_blocks(table)
    assert [len(stages[s]) for s in range(3)] == [1568, 1565, 1572]
    assert all(sum(".experts." in n for n in stages[s]) == 1536 for s in range(3))
    S = TensorSpec
    assert table["mtp.0.main_proj.weight"] == S((4096, 12288), E4M3)
    assert table["mtp.0.main_proj.scale"] == S((32, 96), E8M0)
    assert table["mtp.0.main_norm.weight"] == S((4096,), BF16)
    assert table["mtp.2.norm.weight"] == S((4096,), BF16)
    assert table["mtp.2.hc_head_fn"] == S((4, 16384), F32)
    assert table["mtp.2.hc_head_base"] == S((4,), F32) and table["mtp.2.hc_head_scale"] == S((1,), F32)
    assert table["mtp.2.markov_head.markov_w1.weight"] == S((129280, 256), BF16)
    assert table["mtp.2.markov_head.markov_w2.weight"] == S((129280, 256), BF16)
    assert table["mtp.2.confidence_head.proj.weight"] == S((1, 4352), BF16)
    assert table["mtp.1.ffn.experts.7.w1.weight"] == S((2048, 2048), I8)
    assert table["mtp.1.ffn.experts.7.w2.scale"] == S((4096, 64), E8M0)
    assert table["mtp.1.attn.wq_b.weight"] == S((32768, 1024), E4M3) and table["mtp.1.ffn.gate.bias"] == S((256,), F32)
    assert not any(n.endswith(("e_proj.weight", "enorm.weight", "tid2eid")) for n in table if n.startswith("mtp."))


@pytest.mark.parametrize("preset, kind", [("tiny", "preview"), ("tiny-0731", "dspark"), ("tiny-pro-0813", "dspark")])
def test_presets_validate_and_have_their_kind(preset, kind, tmp_path, make_checkpoint_module):
    """The kind config.json names (loader/kinds.py), and the draft the index holds (loader/drafts.py)."""
    path = make_checkpoint_module.make_checkpoint(tmp_path / preset, preset, seed=1)
    cfg = Dsv4Config.from_pretrained(path)
    validate(cfg, Checkpoint(path))
    assert kind_of(cfg).name == kind and method_of(path) == kind_of(cfg).draft
    raw = json.loads((path / "config.json").read_text())
    assert raw["num_nextn_predict_layers"] == 1  # as the releases leave it, whatever the draft


def test_num_nextn_predict_layers_decides_nothing(tiny_0731_ckpt, tmp_path):
    """Vision-Exp says 3, 0731 says 1: either way the three stages are the draft."""
    raw = json.loads((tiny_0731_ckpt / "config.json").read_text())
    for value in (0, 3):
        path = rewrite(tiny_0731_ckpt, tmp_path / str(value), config=dict(raw, num_nextn_predict_layers=value))
        validate(Dsv4Config.from_pretrained(path), Checkpoint(path))
        assert method_of(path) == "dspark"


def test_a_checkpoint_without_draft_drafts_with_nothing(tiny_ckpt, tmp_path):
    tensors = {n: t for n, t in load_all(tiny_ckpt).items() if not n.startswith("mtp.")}
    raw = json.loads((tiny_ckpt / "config.json").read_text())
    path = rewrite(tiny_ckpt, tmp_path / "none", tensors, dict(raw, num_nextn_predict_layers=0,
                                                                  compress_ratios=raw["compress_ratios"][:-1]))
    assert method_of(path) is None
    with pytest.raises(ConfigError, match="holds no draft model.*it cannot draft"):
        check_draft_method("dspark", json.loads((path / "config.json").read_text()), tensor_names(path))


def test_wrong_method_pairings_name_the_checkpoints_method(tiny_ckpt, tiny_0731_ckpt):
    mtp_raw = json.loads((tiny_ckpt / "config.json").read_text())
    dspark_raw = json.loads((tiny_0731_ckpt / "config.json").read_text())
    with pytest.raises(ConfigError, match="method 'mtp' needs an MTP module.*holds a DSpark drafter.*use method 'dspark'"):
        check_draft_method("mtp", dspark_raw, tensor_names(tiny_0731_ckpt))
    with pytest.raises(ConfigError, match="method 'dspark' needs a DSpark drafter.*holds an MTP module.*use method 'mtp'"):
        check_draft_method("dspark", mtp_raw, tensor_names(tiny_ckpt))
    # the config alone (a model that is not a local directory): the DSpark keys still decide
    with pytest.raises(ConfigError, match="use method 'dspark'"):
        check_draft_method("mtp", dspark_raw, None)
    assert check_draft_method("dspark", dspark_raw, tensor_names(tiny_0731_ckpt)).method == "dspark"
    assert check_draft_method("mtp", mtp_raw, tensor_names(tiny_ckpt)).method == "mtp"


def _reshape(t: torch.Tensor) -> torch.Tensor:
    return t[:, :-1].contiguous()


# (what is done to the checkpoint's tensors, a pattern its error must contain)
MALFORMED = {
    "missing markov_w2": (lambda ts: ts.pop("mtp.2.markov_head.markov_w2.weight"),
                          r"mtp\.2\.markov_head\.markov_w2\.weight: missing \(expected \(1024, 8\) bfloat16\)"),
    "main_proj shape": (lambda ts: ts.update({"mtp.0.main_proj.weight": _reshape(ts["mtp.0.main_proj.weight"])}),
                        r"mtp\.0\.main_proj\.weight: expected shape \(64, 192\)"),
    "main_proj scale missing": (lambda ts: ts.pop("mtp.0.main_proj.scale"),
                                r"mtp\.0\.main_proj\.scale: missing block scale of quantized weight mtp\.0\.main_proj"),
    "confidence dtype": (lambda ts: ts.update({"mtp.2.confidence_head.proj.weight":
                                               ts["mtp.2.confidence_head.proj.weight"].float()}),
                         r"mtp\.2\.confidence_head\.proj\.weight: expected dtype \(1, 72\) bfloat16, found \(1, 72\) float32"),
    "hc_head on the wrong stage": (lambda ts: ts.update({"mtp.1.hc_head_fn": ts.pop("mtp.2.hc_head_fn")}),
                                   r"mtp\.2\.hc_head_fn: missing.*mtp\.1\.hc_head_fn: unexpected tensor"),
    "a fourth stage": (lambda ts: ts.update({"mtp.3.attn_norm.weight": ts["mtp.2.attn_norm.weight"].clone()}),
                       r"index holds draft stages \['mtp\.0', 'mtp\.1', 'mtp\.2', 'mtp\.3'\], but "
                       r"dspark_target_layer_ids names 3 target layers"),
    "a stage short": (lambda ts: [ts.pop(n) for n in [n for n in ts if n.startswith("mtp.2.")]],
                      r"index holds draft stages \['mtp\.0', 'mtp\.1'\]"),
    "an MTP module's fusion": (lambda ts: ts.update({"mtp.0.e_proj.weight": ts["mtp.0.main_norm.weight"].clone()}),
                               r"config\.json has the dspark_\* keys of a DSpark drafter but the index holds MTP "
                               r"module tensors \(mtp\.0\.e_proj\.weight\)"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_dspark_tensor_is_named(case, tiny_0731_ckpt, tmp_path):
    tensors = load_all(tiny_0731_ckpt)
    mutate, pattern = MALFORMED[case]
    mutate(tensors)
    path = rewrite(tiny_0731_ckpt, tmp_path / "bad", tensors)
    problems = problems_of(path)
    assert re.search(pattern, problems, flags=re.S), problems


def test_dspark_tensors_without_the_config_keys_are_named(tiny_0731_ckpt, tmp_path):
    raw = json.loads((tiny_0731_ckpt / "config.json").read_text())
    for key in ("dspark_block_size", "dspark_noise_token_id", "dspark_target_layer_ids", "dspark_markov_rank"):
        raw.pop(key)
    raw["compress_ratios"] = raw["compress_ratios"][:5]
    path = rewrite(tiny_0731_ckpt, tmp_path / "nokeys", config=raw)
    assert "the index holds DSpark stage tensors (mtp.0.main_norm.weight, mtp.0.main_proj.weight" in problems_of(path)


@pytest.mark.parametrize("change, message", [
    ({"dspark_markov_rank": None}, r"lacks \['dspark_markov_rank'\]"),
    ({"compress_ratios": [0, 4, 128, 4, 0]}, r"compress_ratios has 5 entries, expected num_hidden_layers \+ one per "
                                             r"DSpark stage \(dspark_target_layer_ids names 3\) = 7"),
    ({"compress_ratios": [0, 4, 128, 4, 0, 4, 0]}, r"gives the DSpark stages \[0, 4, 0\]"),
    ({"dspark_target_layer_ids": [1, 2, 4]}, r"dspark_target_layer_ids=\[1, 2, 4\]: expected distinct main layers"),
    ({"dspark_noise_token_id": 1024}, r"dspark_noise_token_id=1024 is outside the vocabulary \(1024\)"),
    ({"dspark_block_size": 0}, r"dspark_block_size=0 .* must be positive"),
])
def test_bad_dspark_config_is_named(change, message, make_checkpoint_module):
    raw = make_checkpoint_module.make_config("tiny-0731")
    raw.update(change)
    raw = {k: v for k, v in raw.items() if v is not None}
    with pytest.raises(ConfigError, match=message):
        Dsv4Config.from_dict(raw)


def test_draft_load_places_every_stage_tensor(tiny_0731_ckpt):
    """The draft model's load (vLLM streams it the whole checkpoint) fills every stage parameter with
    independently dequantised values, and nothing of the main model."""
    cfg, ckpt = Dsv4Config.from_pretrained(tiny_0731_ckpt), Checkpoint(tiny_0731_ckpt)
    params = empty_params(cfg, ckpt, mtp=True)
    assert {name.split(".")[1] for name in params} == {"0", "1", "2"}
    assert load_official_weights(cfg, stream(ckpt), params, mtp=True) == set(params)
    for name, p in params.items():
        assert not torch.isnan(p.data.float()).any(), name
    main_proj = oracle_dequant_fp8(ckpt.get("mtp.0.main_proj.weight"), ckpt.get("mtp.0.main_proj.scale"))
    assert torch.equal(params["mtp.0.main_proj.weight"].data.float(), main_proj.float())
    w2 = oracle_dequant_mxfp4(ckpt.get("mtp.1.ffn.experts.4.w2.weight"), ckpt.get("mtp.1.ffn.experts.4.w2.scale"))
    assert torch.equal(params["mtp.1.ffn.experts.w2"].data[4].float(), w2.float())
    assert torch.equal(params["mtp.2.markov_head.markov_w1.weight"].data,
                       ckpt.get("mtp.2.markov_head.markov_w1.weight").float())
    assert torch.equal(params["mtp.2.hc_head.fn"].data, ckpt.get("mtp.2.hc_head_fn"))
