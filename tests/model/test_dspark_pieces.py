"""The DSpark drafter's pieces (docs/MODEL.md §16) against vLLM 0.32's own pure-PyTorch ones: the
Markov head and the confidence head (``qwen3_dspark``), which checkpoint tensors are the stages' blocks and
which the heads (``DSparkDeepseekV4ForCausalLM._remap_dspark_name``), and which target layers feed the
drafter (``get_eagle3_aux_layers_from_config``)."""

from __future__ import annotations

import socket
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import load_make_checkpoint
from vllm_dsv4.config import Dsv4Config
from vllm_dsv4.loader.checkpoint import dspark_stage_tensors
from vllm_dsv4.model.dspark import ConfidenceHead, MarkovHead

V, R, D = 1024, 8, 64


@pytest.fixture(scope="module")
def single_process_group():
    """vLLM's parallel state for one process (its LogitsProcessor gathers over the TP group)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with set_current_vllm_config(VllmConfig()):
            parallel_state.init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, "gloo")
            parallel_state.ensure_model_parallel_initialized(1, 1)
    yield


def test_markov_head_matches_vllms(single_process_group):
    """W1[prev] and its bias W2 W1[prev] [B, V], for our head and vLLM's on the same weights."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.models.qwen3_dspark import DSparkMarkovHead

    g = torch.Generator().manual_seed(0)
    w1, w2 = torch.randn(V, R, generator=g), torch.randn(V, R, generator=g) / R**0.5
    ours = MarkovHead(V, R)
    with set_current_vllm_config(VllmConfig()):
        theirs = DSparkMarkovHead(V, V, R, prefix="markov_head")
    with torch.no_grad():
        for head in (ours, theirs):
            head.markov_w1.weight.copy_(w1)
            head.markov_w2.weight.copy_(w2)
    theirs.markov_w2.quant_method.process_weights_after_loading(theirs.markov_w2)  # vLLM's loader does this
    prev = torch.randint(0, V, (5,), generator=g)
    e = ours.markov_w1(prev)
    assert torch.equal(e, theirs.embed(prev))
    from vllm_dsv4.model.layers import fp32_linear

    ours_bias = fp32_linear(e, ours.markov_w2.weight)
    with set_current_vllm_config(VllmConfig()):
        theirs_bias = theirs.bias(e, LogitsProcessor(V))
    torch.testing.assert_close(ours_bias, theirs_bias.float(), rtol=1e-5, atol=1e-5)


def test_confidence_head_matches_vllms(single_process_group):
    """sigmoid(w . [h ; W1[prev]]), no bias, fp32: V4's head as vLLM builds it (``with_markov``)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.models.qwen3_dspark import DSparkConfidenceHead

    g = torch.Generator().manual_seed(1)
    w = torch.randn(1, D + R, generator=g) / (D + R) ** 0.5
    ours = ConfidenceHead(D + R)
    with set_current_vllm_config(VllmConfig()):
        theirs = DSparkConfidenceHead(D + R, prefix="confidence_head", bias=False, with_markov=True)
    with torch.no_grad():
        ours.proj.weight.copy_(w)
        theirs.proj.weight.copy_(w)
    theirs.proj.quant_method.process_weights_after_loading(theirs.proj)
    h, e = torch.randn(6, D, generator=g), torch.randn(6, R, generator=g)
    torch.testing.assert_close(ours(h, e), torch.sigmoid(theirs(h, e)), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("preset", ["tiny-0731", "tiny-pro-0813"])
def test_block_and_head_tensors_are_vllms(preset):
    """Our table's stage tensors are vLLM's per-stage block parameters, and our stage extras (stage 0's
    fusion, the last stage's heads) are the ones vLLM keeps at model level."""
    from vllm.models.deepseek_v4.nvidia.dspark import DSparkDeepseekV4ForCausalLM

    cfg = Dsv4Config.from_dict(load_make_checkpoint().make_config(preset))
    vllm_model = SimpleNamespace(model=SimpleNamespace(confidence_head=object()))
    extras = {"main_proj.", "main_norm.", "norm.", "hc_head_", "markov_head.", "confidence_head."}
    for s in range(cfg.dspark.num_stages):
        for name in dspark_stage_tensors(cfg, s):
            rest = name[len(f"mtp.{s}."):]
            mapped = DSparkDeepseekV4ForCausalLM._remap_dspark_name(vllm_model, name)
            if rest.startswith(tuple(extras)):
                assert mapped == f"model.{rest}", name
            else:
                assert mapped == f"model.layers.{s}.{rest}", name
    assert DSparkDeepseekV4ForCausalLM._remap_dspark_name(vllm_model, "layers.0.attn.wkv.weight") is None


def test_the_target_layers_are_vllms():
    """vLLM captures the streams after layer i when i + 1 is in its list ("capture after"); ours are the
    outputs of the layers dspark_target_layer_ids names."""
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config

    raw = load_make_checkpoint().make_config("flash-0731", num_layers=43)
    hf = SimpleNamespace(model_type="deepseek_v4", **{k: v for k, v in raw.items() if k.startswith("dspark_")})
    spec = SimpleNamespace(draft_model_config=SimpleNamespace(hf_config=hf))
    after = get_eagle3_aux_layers_from_config(spec)
    assert [i - 1 for i in after] == list(Dsv4Config.from_dict(raw).dspark.target_layer_ids) == [40, 41, 42]
