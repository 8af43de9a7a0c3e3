"""The official tensor table, the Checkpoint reader and validate() on good and malformed checkpoints."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from vllm_dsv4.config import ConfigError, Dsv4Config
from vllm_dsv4.loader.checkpoint import (
    Checkpoint,
    CheckpointError,
    TensorSpec,
    expected_tensors,
    validate,
)

E4M3, E8M0, BF16, F32 = torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.bfloat16, torch.float32


# ---- helpers --------------------------------------------------------------------------------


def load_all(ckpt: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(ckpt.glob("model*.safetensors")):
        out.update(load_file(str(f)))
    return out


def rewrite(src: Path, dst: Path, tensors: dict[str, torch.Tensor] | None = None, config: dict | None = None) -> Path:
    """Copy ``src``'s config/tokenizer to ``dst`` and store ``tensors`` as one model.safetensors."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix == ".json" and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)
    if config is not None:
        (dst / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in (tensors if tensors is not None else load_all(src)).items()},
              str(dst / "model.safetensors"))
    return dst


def problems_of(path: Path) -> str:
    with pytest.raises(CheckpointError) as info:
        validate(Dsv4Config.from_pretrained(path), Checkpoint(path))
    return str(info.value)


# ---- the table against the spec (§8.1) ------------------------------------------------------


def test_flash_table_matches_spec(make_checkpoint_module):
    cfg = Dsv4Config.from_dict(make_checkpoint_module.make_config("flash"))  # 6 layers: 0 0 4 128 4 128 + MTP 0
    t = expected_tensors(cfg)
    S = TensorSpec
    want = {
        "embed.weight": S((129280, 4096), BF16),
        "head.weight": S((129280, 4096), BF16),
        "hc_head_fn": S((4, 16384), F32),
        "hc_head_scale": S((1,), F32),
        "layers.0.hc_attn_fn": S((24, 16384), F32),
        "layers.0.hc_ffn_scale": S((3,), F32),
        "layers.0.attn.wq_a.weight": S((1024, 4096), E4M3),
        "layers.0.attn.wq_a.scale": S((8, 32), E8M0),
        "layers.0.attn.wq_b.weight": S((32768, 1024), E4M3),
        "layers.0.attn.wq_b.scale": S((256, 8), E8M0),
        "layers.0.attn.wkv.scale": S((4, 32), E8M0),
        "layers.0.attn.wo_a.weight": S((8192, 4096), E4M3),
        "layers.0.attn.wo_a.scale": S((64, 32), E8M0),
        "layers.0.attn.wo_b.scale": S((32, 64), E8M0),
        "layers.0.attn.attn_sink": S((64,), F32),
        "layers.2.attn.compressor.wkv.weight": S((1024, 4096), BF16),
        "layers.2.attn.compressor.ape": S((4, 1024), F32),
        "layers.2.attn.compressor.norm.weight": S((512,), BF16),
        "layers.3.attn.compressor.wgate.weight": S((512, 4096), BF16),
        "layers.3.attn.compressor.ape": S((128, 512), F32),
        "layers.2.attn.indexer.wq_b.weight": S((8192, 1024), E4M3),
        "layers.2.attn.indexer.wq_b.scale": S((64, 8), E8M0),
        "layers.2.attn.indexer.weights_proj.weight": S((64, 4096), BF16),
        "layers.2.attn.indexer.compressor.wkv.weight": S((256, 4096), BF16),
        "layers.2.attn.indexer.compressor.ape": S((4, 256), F32),
        "layers.2.attn.indexer.compressor.norm.weight": S((128,), BF16),
        "layers.0.ffn.gate.weight": S((256, 4096), BF16),
        "layers.2.ffn.gate.tid2eid": S((129280, 6), torch.int64),
        "layers.3.ffn.gate.bias": S((256,), F32),
        "layers.5.ffn.experts.255.w1.weight": S((2048, 2048), torch.int8),
        "layers.5.ffn.experts.255.w1.scale": S((2048, 128), E8M0),
        "layers.5.ffn.experts.0.w2.weight": S((4096, 1024), torch.int8),
        "layers.5.ffn.experts.0.w2.scale": S((4096, 64), E8M0),
        "layers.0.ffn.shared_experts.w3.scale": S((16, 32), E8M0),
        "layers.0.ffn.shared_experts.w2.weight": S((4096, 2048), E4M3),
        "layers.0.ffn.shared_experts.w2.scale": S((32, 16), E8M0),
        "mtp.0.e_proj.weight": S((4096, 4096), E4M3),
        "mtp.0.h_proj.scale": S((32, 32), E8M0),
        "mtp.0.hc_head_fn": S((4, 16384), F32),
        "mtp.0.ffn.gate.bias": S((256,), F32),
    }
    for name, spec in want.items():
        assert t.get(name) == spec, (name, t.get(name), spec)
    # Which layers carry which optional parts.
    assert not any(n.startswith(("layers.0.attn.compressor", "layers.1.attn.", "mtp.0.attn.compressor"))
                   and "compressor" in n for n in t)
    assert not any(n.startswith("layers.3.attn.indexer") for n in t)
    assert [i for i in range(6) if f"layers.{i}.ffn.gate.tid2eid" in t] == [0, 1, 2]
    assert [i for i in range(6) if f"layers.{i}.ffn.gate.bias" in t] == [3, 4, 5]
    assert "mtp.0.ffn.gate.tid2eid" not in t and "mtp.0.embed.weight" not in t


def test_unquantized_table_has_no_scales(make_checkpoint_module):
    t = expected_tensors(Dsv4Config.from_dict(make_checkpoint_module.make_config("tiny", quantized=False)))
    assert not any(n.endswith(".scale") for n in t)
    assert t["layers.0.attn.wq_b.weight"] == TensorSpec((256, 32), BF16)
    assert t["layers.0.ffn.experts.3.w2.weight"] == TensorSpec((64, 32), BF16)


# ---- the generated checkpoints --------------------------------------------------------------


@pytest.mark.parametrize("variant", ["tiny_ckpt", "tiny_ckpt_unquantized"])
def test_generated_tiny_validates(variant, request):
    path = request.getfixturevalue(variant)
    cfg = Dsv4Config.from_pretrained(path)
    assert cfg.compress_ratios == (0, 4, 128, 4, 0) and cfg.index_n_heads == 16
    assert cfg.quantized == (variant == "tiny_ckpt")
    ckpt = Checkpoint(path)
    validate(cfg, ckpt)
    assert set(ckpt.names()) == set(expected_tensors(cfg))
    sink = ckpt.get("layers.0.attn.attn_sink")
    assert sink.dtype == F32 and sink.shape == (4,) and sink.abs().sum() > 0


def test_generated_tiny_randomises_zero_defaults(tiny_ckpt):
    ckpt = Checkpoint(tiny_ckpt)
    for name in ("layers.0.attn.attn_sink", "layers.1.attn.compressor.ape", "layers.1.attn.indexer.compressor.ape",
                 "layers.2.ffn.gate.bias", "layers.0.hc_attn_base", "hc_head_base", "mtp.0.hc_head_base"):
        assert ckpt.get(name).float().std() > 0.1, name
    tid2eid = ckpt.get("layers.1.ffn.gate.tid2eid")
    assert tid2eid.dtype == torch.int64 and tid2eid.shape == (1024, 2)
    assert (tid2eid[:, 0] != tid2eid[:, 1]).all() and tid2eid.min() >= 0 and tid2eid.max() < 8
    assert len(torch.unique(tid2eid)) == 8


def test_quantized_and_unquantized_store_the_same_function(tiny_ckpt, tiny_ckpt_unquantized):
    """The maker stores the unquantised checkpoint as its own dequantisation of the quantised one;
    the oracle's bit-level decoders (written from the format definitions, not vllm_dsv4's) read
    the quantised bytes to the same bf16 values."""
    from tests.oracle.hf_oracle import oracle_dequant_fp8, oracle_dequant_mxfp4

    q, u = Checkpoint(tiny_ckpt), Checkpoint(tiny_ckpt_unquantized)
    decoded = 0
    for name in u.names():
        a, b = q.get(name), u.get(name)
        if a.dtype in (E4M3, torch.int8):
            decode = oracle_dequant_fp8 if a.dtype == E4M3 else oracle_dequant_mxfp4
            a = decode(a, q.get(name.replace(".weight", ".scale"))).to(BF16)
            decoded += 1
        assert a.dtype == b.dtype and torch.equal(a.float(), b.float()), name
    assert decoded > 100  # every FP8 linear and MXFP4 expert matrix of the tiny model


def test_same_seed_same_weights_other_seed_differs(tiny_ckpt, tmp_path, make_checkpoint_module):
    again = make_checkpoint_module.make_checkpoint(tmp_path / "again", "tiny", seed=0)
    other = make_checkpoint_module.make_checkpoint(tmp_path / "other", "tiny", seed=1)
    a, b, c = Checkpoint(tiny_ckpt), Checkpoint(again), Checkpoint(other)
    name = "layers.3.ffn.experts.5.w2.weight"
    assert torch.equal(a.get(name), b.get(name))
    assert not torch.equal(a.get(name), c.get(name))


def test_checkpoint_reader_single_file_and_index(tiny_ckpt, tmp_path):
    ckpt = Checkpoint(tiny_ckpt)
    assert ckpt.shard_of("layers.2.attn.wkv.weight") != ckpt.shard_of("embed.weight")
    assert ckpt.spec("layers.2.attn.wkv.weight") == TensorSpec((64, 64), E4M3)
    single = rewrite(tiny_ckpt, tmp_path / "single")
    one = Checkpoint(single)
    assert one.specs() == ckpt.specs()
    assert torch.equal(one.get("head.weight"), ckpt.get("head.weight"))
    with pytest.raises(CheckpointError, match="not in checkpoint"):
        one.get("layers.9.attn_norm.weight")


def test_checkpoint_reader_broken_index(tiny_ckpt, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_ckpt, broken)
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    index["weight_map"]["layers.0.attn.ghost"] = index["weight_map"]["layers.0.attn.wkv.weight"]
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"layers\.0\.attn\.ghost"):
        Checkpoint(broken)
    index["weight_map"]["layers.0.attn.ghost"] = "model-nowhere.safetensors"
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="missing shard model-nowhere.safetensors"):
        Checkpoint(broken)
    with pytest.raises(CheckpointError, match="neither"):
        Checkpoint(tmp_path)


# ---- malformed checkpoints ------------------------------------------------------------------


def test_missing_tensor(tiny_ckpt, tmp_path):
    t = load_all(tiny_ckpt)
    del t["layers.2.attn.compressor.ape"]
    msg = problems_of(rewrite(tiny_ckpt, tmp_path / "c", t))
    assert "layers.2.attn.compressor.ape: missing (expected (128, 64) float32)" in msg
    assert "1 problem" in msg


def test_extra_tensor(tiny_ckpt, tmp_path):
    t = load_all(tiny_ckpt)
    t["layers.0.attn.compressor.ape"] = torch.zeros(4, 128)  # layer 0 is SWA-only
    msg = problems_of(rewrite(tiny_ckpt, tmp_path / "c", t))
    assert "layers.0.attn.compressor.ape: unexpected tensor (4, 128) float32" in msg
    assert "compress_ratios" in msg


def test_wrong_shape(tiny_ckpt, tmp_path):
    t = load_all(tiny_ckpt)
    t["layers.1.attn.wq_b.weight"] = t["layers.1.attn.wq_b.weight"][:255]
    msg = problems_of(rewrite(tiny_ckpt, tmp_path / "c", t))
    assert ("layers.1.attn.wq_b.weight: expected shape (256, 32) float8_e4m3fn, "
            "found (255, 32) float8_e4m3fn") in msg


def test_wrong_dtype(tiny_ckpt, tmp_path):
    t = load_all(tiny_ckpt)
    t["layers.3.attn.attn_sink"] = t["layers.3.attn.attn_sink"].to(BF16)
    t["layers.1.ffn.gate.tid2eid"] = t["layers.1.ffn.gate.tid2eid"].to(torch.int32)
    msg = problems_of(rewrite(tiny_ckpt, tmp_path / "c", t))
    assert "layers.3.attn.attn_sink: expected dtype (4,) float32, found (4,) bfloat16" in msg
    assert "layers.1.ffn.gate.tid2eid: expected dtype (1024, 2) int64, found (1024, 2) int32" in msg
    assert "2 problem" in msg


def test_missing_scale(tiny_ckpt, tmp_path):
    t = load_all(tiny_ckpt)
    del t["layers.0.attn.wkv.scale"]
    del t["layers.2.ffn.experts.7.w3.scale"]
    msg = problems_of(rewrite(tiny_ckpt, tmp_path / "c", t))
    assert ("layers.0.attn.wkv.scale: missing block scale of quantized weight layers.0.attn.wkv.weight "
            "(expected (1, 1) float8_e8m0fnu)") in msg
    assert ("layers.2.ffn.experts.7.w3.scale: missing block scale of quantized weight "
            "layers.2.ffn.experts.7.w3.weight (expected (32, 2) float8_e8m0fnu)") in msg


def test_quantized_weights_with_unquantized_config(tiny_ckpt, tmp_path):
    config = json.loads((tiny_ckpt / "config.json").read_text())
    del config["quantization_config"]
    msg = problems_of(rewrite(tiny_ckpt, tmp_path / "c", config=config))
    assert "config.json has no quantization_config" in msg
    assert "... and" in msg  # many problems, only the first 10 listed
    assert msg.count("\n  ") == 11


def test_many_problems_reported_together(tiny_ckpt, tmp_path):
    t = load_all(tiny_ckpt)
    gone = ["embed.weight", "layers.3.ffn_norm.weight", "mtp.0.enorm.weight"]
    for n in gone:
        del t[n]
    msg = problems_of(rewrite(tiny_ckpt, tmp_path / "c", t))
    assert all(f"{n}: missing" in msg for n in gone) and "3 problem" in msg


def test_unsupported_compress_ratio(tiny_ckpt, tmp_path):
    config = json.loads((tiny_ckpt / "config.json").read_text())
    config["compress_ratios"] = [0, 4, 64, 4, 0]
    path = rewrite(tiny_ckpt, tmp_path / "c", config=config)
    with pytest.raises(ConfigError, match=r"compress_ratios has unsupported values \[64\]; supported: 0, 1, 4, 128"):
        Dsv4Config.from_pretrained(path)


def test_compress_ratios_too_short(tiny_ckpt, tmp_path):
    config = json.loads((tiny_ckpt / "config.json").read_text())
    config["compress_ratios"] = [0, 4, 128, 4]  # MTP entry missing
    path = rewrite(tiny_ckpt, tmp_path / "c", config=config)
    with pytest.raises(ConfigError, match=r"compress_ratios has 4 entries, expected "
                                          r"num_hidden_layers \+ num_nextn_predict_layers = 5"):
        Dsv4Config.from_pretrained(path)


def test_layer_schedule_mismatch_is_named(tiny_ckpt, tmp_path):
    # A config that says layer 2 is C4 while the weights are C128: names the compressor tensors.
    config = json.loads((tiny_ckpt / "config.json").read_text())
    config["compress_ratios"] = [0, 4, 4, 4, 0]
    msg = problems_of(rewrite(tiny_ckpt, tmp_path / "c", config=config))
    assert "layers.2.attn.compressor.wkv.weight: expected shape (128, 64) bfloat16, found (64, 64) bfloat16" in msg
    assert "layers.2.attn.indexer.wq_b.weight: missing" in msg


# ---- presets and tokenizer ------------------------------------------------------------------

# docs/MODEL.md §13.1, verbatim.
SPEC_TINY = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
    "vocab_size": 1024, "hidden_size": 64, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64, "qk_rope_head_dim": 16,
    "q_lora_rank": 32, "o_groups": 2, "o_lora_rank": 16, "sliding_window": 16,
    "compress_ratios": [0, 4, 128, 4, 0],
    "compress_rope_theta": 160000, "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 256,
                     "beta_fast": 32, "beta_slow": 1},
    "max_position_embeddings": 4096,
    "index_n_heads": 16, "index_head_dim": 32, "index_topk": 8,
    "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
    "num_hash_layers": 2, "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc", "norm_topk_prob": True,
    "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "hidden_act": "silu",
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-6,
    "num_nextn_predict_layers": 1, "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False,
}


def test_preset_configs(make_checkpoint_module, tiny_ckpt, tiny_ckpt_unquantized):
    mk = make_checkpoint_module
    q = json.loads((tiny_ckpt / "config.json").read_text())
    u = json.loads((tiny_ckpt_unquantized / "config.json").read_text())
    for raw in (q, u):
        assert {k: raw[k] for k in SPEC_TINY} == SPEC_TINY
        assert raw["torch_dtype"] == "bfloat16"
    assert q["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                        "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}
    assert q["expert_dtype"] == "fp4"
    assert "quantization_config" not in u and "expert_dtype" not in u

    kt = mk.make_config("ktiny")
    assert (kt["hidden_size"], kt["head_dim"], kt["qk_rope_head_dim"], kt["index_head_dim"], kt["index_topk"],
            kt["n_routed_experts"], kt["num_experts_per_tok"], kt["max_position_embeddings"]) == (
        256, 512, 64, 128, 64, 16, 4, 65536)
    assert kt["compress_ratios"] == [0, 4, 128, 4, 0] and kt["rope_scaling"]["original_max_position_embeddings"] == 4096

    fl = mk.make_config("flash")
    assert fl["compress_ratios"] == [0, 0, 4, 128, 4, 128, 0] and fl["num_hash_layers"] == 3
    assert (fl["hidden_size"], fl["num_attention_heads"], fl["q_lora_rank"], fl["o_groups"], fl["index_topk"],
            fl["n_routed_experts"], fl["moe_intermediate_size"], fl["vocab_size"]) == (
        4096, 64, 1024, 8, 512, 256, 2048, 129280)
    fl2 = mk.make_config("flash", num_layers=2)
    assert fl2["compress_ratios"] == [0, 0, 0] and fl2["num_hash_layers"] == 2
    full = mk.make_config("flash", num_layers=43)
    assert full["compress_ratios"] == [0, 0] + [4, 128] * 20 + [4] + [0]


def _vllm_encoder():
    """vLLM's DeepSeek-V4 chat encoder, loaded by path (stdlib-only file; avoids importing vllm)."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vllm not installed")
    path = Path(list(spec.submodule_search_locations)[0]) / "tokenizers" / "deepseek_v4_encoding.py"
    if not path.exists():
        pytest.skip(f"{path} not found")
    module_spec = importlib.util.spec_from_file_location("dsv4_vllm_encoding", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def test_tokenizer_special_tokens(tiny_ckpt):
    import tests.oracle.hf_oracle  # noqa: F401  (hides the broken vision packages before transformers)
    from transformers import AutoTokenizer

    enc = _vllm_encoder()
    tok = AutoTokenizer.from_pretrained(str(tiny_ckpt))
    assert (tok.bos_token, tok.bos_token_id, tok.eos_token, tok.eos_token_id) == (
        enc.bos_token, 0, enc.eos_token, 1)
    assert len(tok) <= 1024
    markers = [enc.USER_SP_TOKEN, enc.ASSISTANT_SP_TOKEN, enc.LATEST_REMINDER_SP_TOKEN,
               enc.thinking_start_token, enc.thinking_end_token, enc.dsml_token, *enc.DS_TASK_SP_TOKENS.values()]
    for m in markers:
        ids = tok.encode(m, add_special_tokens=False)
        assert len(ids) == 1 and ids[0] < 16, (m, ids)
    gen = json.loads((tiny_ckpt / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (0, 1)

    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is 7 times 8?"},
                {"role": "assistant", "content": "56", "reasoning_content": "7*8=56"},
                {"role": "user", "content": "Thanks!"}]
    prompt = enc.encode_messages(messages, thinking_mode="thinking")
    ids = tok.encode(prompt, add_special_tokens=False)
    assert ids[0] == 0 and tok.decode(ids) == prompt
    assert tok.convert_ids_to_tokens(ids[-2:]) == [enc.ASSISTANT_SP_TOKEN, enc.thinking_start_token]
    # Markers stay visible when special tokens are skipped (reasoning / tool parsers need them).
    assert enc.thinking_start_token in tok.decode(ids, skip_special_tokens=True)
    assert tok.decode(ids, skip_special_tokens=True).find(enc.bos_token) == -1


# ---- V4-Flash-Base: FP8 routed experts, float32 scales -----------------------------------------


def test_flash_base_table_matches_spec(make_checkpoint_module):
    """Routed experts are FP8 128x128 blocks, not packed; every block scale is float32."""
    raw = make_checkpoint_module.make_config("flash-base")
    assert raw["expert_dtype"] == "fp8" and raw["quantization_config"]["weight_block_size"] == [128, 128]
    t = expected_tensors(Dsv4Config.from_dict(raw))
    S = TensorSpec
    want = {
        "layers.5.ffn.experts.255.w1.weight": S((2048, 4096), E4M3),
        "layers.5.ffn.experts.255.w1.scale": S((16, 32), F32),
        "layers.0.ffn.experts.0.w2.weight": S((4096, 2048), E4M3),
        "layers.0.ffn.experts.0.w2.scale": S((32, 16), F32),
        "layers.3.ffn.experts.7.w3.scale": S((16, 32), F32),
        "layers.0.attn.wq_a.scale": S((8, 32), F32),
        "layers.2.attn.indexer.wq_b.scale": S((64, 8), F32),
        "layers.0.ffn.shared_experts.w2.scale": S((32, 16), F32),
        "mtp.0.e_proj.scale": S((32, 32), F32),
        "mtp.0.ffn.experts.9.w2.weight": S((4096, 2048), E4M3),
        "layers.3.ffn.gate.bias": S((256,), F32),
        "layers.2.attn.compressor.wkv.weight": S((1024, 4096), BF16),
    }
    for name, spec in want.items():
        assert t.get(name) == spec, (name, t.get(name), spec)
    assert not any(s.dtype in (E8M0, torch.int8) for s in t.values())


def test_generated_tiny_base_validates(tiny_base_ckpt):
    from vllm_dsv4.loader.kinds import kind_of, kind_of_tensors

    cfg, ckpt = Dsv4Config.from_pretrained(tiny_base_ckpt), Checkpoint(tiny_base_ckpt)
    validate(cfg, ckpt)
    assert kind_of(cfg).name == kind_of_tensors(ckpt.specs()).name == "base"
    scales = [n for n in ckpt.names() if n.endswith(".scale")]
    assert scales and all(ckpt.spec(n).dtype == F32 for n in scales)
    assert ckpt.spec("layers.2.ffn.experts.5.w2.weight") == TensorSpec((64, 32), E4M3)
    s = ckpt.get("layers.2.ffn.experts.5.w2.scale")
    assert torch.equal(torch.exp2(torch.log2(s).round()), s)  # powers of two


@pytest.mark.parametrize("tensors, expert_dtype, found, fix", [
    ("tiny_base_ckpt", "fp4", "DeepSeek-V4-Flash-Base (FP8 routed experts, float32 scales", "'fp8'"),
    ("tiny_ckpt", "fp8", "DeepSeek-V4-Flash / V4-Pro (MXFP4 routed experts, e8m0 scales", "'fp4'"),
])
def test_tensors_of_another_kind_are_named_first(request, tmp_path, tensors, expert_dtype, found, fix):
    src = request.getfixturevalue(tensors)
    config = json.loads((src / "config.json").read_text())
    config["expert_dtype"] = expert_dtype
    msg = problems_of(rewrite(src, tmp_path / "c", config=config))
    first = msg.split("\n  ")[1]
    assert f"but the tensors are {found}" in first and f"set expert_dtype {fix}" in first, first


def test_base_tensor_problems_are_named(tiny_base_ckpt, tmp_path):
    t = load_all(tiny_base_ckpt)
    t["layers.1.attn.wq_b.scale"] = t["layers.1.attn.wq_b.scale"].to(E8M0)  # an e8m0 scale in a Base checkpoint
    del t["layers.2.ffn.experts.4.w1.scale"]
    t["mtp.0.ffn.experts.1.w2.weight"] = t["mtp.0.ffn.experts.1.w2.weight"][:, :16]
    msg = problems_of(rewrite(tiny_base_ckpt, tmp_path / "c", t))
    assert "layers.1.attn.wq_b.scale: expected dtype (2, 1) float32, found (2, 1) float8_e8m0fnu" in msg
    assert ("layers.2.ffn.experts.4.w1.scale: missing block scale of quantized weight "
            "layers.2.ffn.experts.4.w1.weight (expected (1, 1) float32)") in msg
    assert ("mtp.0.ffn.experts.1.w2.weight: expected shape (64, 32) float8_e4m3fn, "
            "found (64, 16) float8_e4m3fn") in msg
    assert "3 problem" in msg
