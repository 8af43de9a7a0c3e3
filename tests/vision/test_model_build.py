"""The multimodal class built on the CPU from a ``tiny-vision`` checkpoint: vLLM resolves the checkpoint's
``DeepseekV4ForCausalLM`` to it (patches.py patch 9), every checkpoint tensor loads into a parameter by
its official name, every parameter is loaded, the backbone's norms take the file's ``rms_norm_eps``, and
the text class refuses a Vision checkpoint."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.csrc_triton.kernel_cases import vllm_config_for
from tests.vision.vllm_tower import init_single_process_vllm
from vllm_dsv4.config import ConfigError
from vllm_dsv4.model.layers import RMSNorm
from vllm_dsv4.model.mhc import HyperConnection, HyperHead


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, make_checkpoint_module):
    return make_checkpoint_module.make_checkpoint(tmp_path_factory.mktemp("tiny_vision_build"), "tiny-vision",
                                                  quantized=True, seed=1)


@pytest.fixture(scope="module")
def built(ckpt):
    from vllm.config import set_current_vllm_config

    from vllm_dsv4.vision.model import DeepseekV4ForConditionalGeneration

    config = vllm_config_for(ckpt)
    with set_current_vllm_config(config):
        init_single_process_vllm()
        return config, DeepseekV4ForConditionalGeneration(vllm_config=config)


def checkpoint_tensors(ckpt):
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    for shard in sorted(set(index.values())):
        yield from load_file(str(ckpt / shard)).items()


def test_vllm_resolves_the_multimodal_class(built):
    config, _ = built
    assert config.model_config.architectures == ["DeepseekV4ForConditionalGeneration"]
    assert config.model_config.is_multimodal_model


def test_every_tensor_loads_and_every_parameter_is_loaded(built, ckpt):
    config, model = built
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(config):
        loaded = model.load_weights(checkpoint_tensors(ckpt))
    assert loaded == {name for name, _ in model.named_parameters()}
    raw = dict(checkpoint_tensors(ckpt))
    assert torch.equal(model.vision.blocks[1].mlp.w1.weight, raw["vision.blocks.1.mlp.w1.weight"].to(torch.bfloat16))
    assert torch.equal(model.image_newline, raw["image_newline"].to(torch.bfloat16))
    gate = model.language_model.layers[0].ffn.gate  # a hash layer
    assert torch.equal(gate.bias_vl, raw["layers.0.ffn.gate.bias_vl"])


def test_backbone_norms_take_the_files_eps(built, ckpt):
    _, model = built
    assert json.loads((ckpt / "config.json").read_text())["rms_norm_eps"] == 1e-20
    text = {m.eps for n, m in model.language_model.named_modules() if isinstance(m, RMSNorm)}
    mixers = {m.rms_eps for m in model.language_model.modules() if isinstance(m, (HyperConnection, HyperHead))}
    tower = {m.eps for m in model.vision.modules() if isinstance(m, RMSNorm)}
    assert text == mixers == {1e-20} and tower == {1e-6}


def test_with_images_off_the_tower_is_neither_built_nor_loaded(ckpt):
    """``limit_mm_per_prompt={"image": 0}``: text only; the tower's tensors are checked, not loaded."""
    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config

    from vllm_dsv4.vision.model import DeepseekV4ForConditionalGeneration

    config = VllmConfig(model_config=ModelConfig(model=str(ckpt), skip_tokenizer_init=True, dtype="bfloat16",
                                                 max_model_len=4096, limit_mm_per_prompt={"image": 0}))
    with set_current_vllm_config(config):
        init_single_process_vllm()
        model = DeepseekV4ForConditionalGeneration(vllm_config=config)
        names = {name for name, _ in model.named_parameters()}
        assert not any(n.startswith(("vision.", "aligner.", "image_")) for n in names)
        assert model.load_weights(checkpoint_tensors(ckpt)) == names
    ids = torch.tensor([5, 129257, 129259])
    assert torch.equal(model.embed_input_ids(ids), model.language_model.embed_input_ids(ids))


def test_the_text_class_refuses_a_vision_checkpoint(built):
    from vllm.config import set_current_vllm_config

    from vllm_dsv4.model.decoder import DeepseekV4ForCausalLM

    config, _ = built
    with set_current_vllm_config(config), pytest.raises(ConfigError, match="vision tower"):
        DeepseekV4ForCausalLM(vllm_config=config)
