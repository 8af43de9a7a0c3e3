"""The transformers oracle loads our official-format tiny checkpoints and computes a sane function."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from tests.oracle import hf_oracle  # noqa: E402
from tests.oracle.hf_oracle import (  # noqa: E402
    hf_config_from_json,
    load_hf_reference,
    oracle_dequant_fp8,
    oracle_dequant_mxfp4,
)
from vllm_dsv4.loader.checkpoint import Checkpoint  # noqa: E402

T_EQ = 136  # past token 127: the C128 layer emits its first compressed entry
T_SPREAD = 64


@pytest.fixture(scope="module")
def hf_models(tiny_ckpt, tiny_ckpt_unquantized):
    return load_hf_reference(tiny_ckpt), load_hf_reference(tiny_ckpt_unquantized)


@pytest.fixture(scope="module")
def prompt():
    g = torch.Generator().manual_seed(1234)
    return torch.randint(15, 1024, (1, T_EQ), generator=g)  # ordinary (non-special) tokens


def test_oracle_decoders_on_known_bytes():
    q = torch.tensor([[0x38, 0xB8, 0x7E, 0x01]], dtype=torch.uint8).view(torch.float8_e4m3fn)
    s = torch.tensor([[130]], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    assert oracle_dequant_fp8(q, s).tolist() == [[8.0, -8.0, 448.0 * 8, 2.0**-9 * 8]]
    p = torch.tensor([[0x71, 0xF9] + [0] * 14], dtype=torch.uint8).view(torch.int8)
    s4 = torch.tensor([[126]], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    assert oracle_dequant_mxfp4(p, s4)[0, :4].tolist() == [0.25, 3.0, -0.25, -3.0]


def test_oracle_decoders_agree_with_torch_on_all_codes():
    # Every e4m3 byte except NaN (0x7F / 0xFF) against torch's own conversion.
    codes = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    q = codes.view(1, -1).view(torch.float8_e4m3fn)
    one = torch.tensor([[127, 127]], dtype=torch.uint8).view(torch.float8_e8m0fnu)
    assert torch.equal(oracle_dequant_fp8(q, one), q.float())


def test_hf_schedule_matches_compress_ratios(tiny_ckpt):
    raw = json.loads((tiny_ckpt / "config.json").read_text())
    cfg = hf_config_from_json(raw)
    assert cfg.layer_types == ["sliding_attention", "compressed_sparse_attention",
                               "heavily_compressed_attention", "compressed_sparse_attention"]
    assert cfg.mlp_layer_types == ["hash_moe", "hash_moe", "moe", "moe"]
    assert cfg.rope_parameters["compress"]["rope_type"] == "yarn"
    assert cfg.rope_parameters["main"]["rope_type"] == "default"


def test_quantized_and_unquantized_give_identical_logits(hf_models, prompt):
    mq, mu = hf_models
    with torch.no_grad():
        a, b = mq(prompt).logits, mu(prompt).logits
    assert a.shape == (1, T_EQ, 1024)
    assert torch.isfinite(a).all()
    assert torch.equal(a, b), (a - b).abs().max()


def test_logits_not_degenerate(hf_models, prompt):
    mq, _ = hf_models
    with torch.no_grad():
        logits = mq(prompt[:, :T_SPREAD]).logits[0]
    assert torch.isfinite(logits).all()
    assert logits.abs().max() < 50
    assert (logits.std(dim=-1) > 0.1).all()
    top1 = logits.argmax(dim=-1)
    assert len(torch.unique(top1)) > T_SPREAD // 4, top1


def test_oracle_names_are_transformers_own_conversion(tiny_ckpt_unquantized):
    """transformers reads an official-format checkpoint through the conversion mapping it ships for
    ``deepseek_v4`` (renames, experts merged into ``gate_up_proj`` / ``down_proj``). The oracle's
    hand-written tables (official -> HF names) must build the same model tensor for tensor, and
    every row of them must name a tensor of the tiny checkpoint, so the comparison covers it."""
    from transformers import DeepseekV4ForCausalLM

    theirs, info = DeepseekV4ForCausalLM.from_pretrained(
        str(tiny_ckpt_unquantized), dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"] and not info["error_msgs"], info
    theirs, ours = theirs.state_dict(), load_hf_reference(tiny_ckpt_unquantized).state_dict()
    assert theirs.keys() == ours.keys()
    assert [n for n in ours if not torch.equal(ours[n], theirs[n])] == []

    names = Checkpoint(tiny_ckpt_unquantized).names()
    unused = [row for row in hf_oracle._LAYER if not any(n.startswith("layers.") and n.endswith("." + row)
                                                        for n in names)]
    assert unused == [] and set(hf_oracle._TOP) <= set(names), unused


@pytest.mark.parametrize("fixture", ["tiny_ckpt", "tiny_base_ckpt"])
def test_transformers_reads_the_release_formats_as_the_oracle_does(request, fixture, prompt):
    """transformers loading the checkpoint itself (its FP8 quantizer's dequantize mode: ``.scale`` read as
    ``weight_scale_inv``; e8m0 or float32 scales; MXFP4 or FP8 routed experts) computes the oracle's logits
    bit for bit: the oracle's decoders and names read both formats as transformers does. (transformers'
    FP8 loading needs ``accelerate``: scripts/install.sh installs it.)"""
    from transformers import DeepseekV4ForCausalLM, FineGrainedFP8Config

    path = request.getfixturevalue(fixture)
    hf = DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager",
                                               quantization_config=FineGrainedFP8Config(dequantize=True))
    hf = hf.float().eval()  # its unquantized bf16 tensors (embedding, norms, router) as stored: exact in fp32
    with torch.no_grad():
        assert torch.equal(hf(prompt).logits, load_hf_reference(path)(prompt).logits)
