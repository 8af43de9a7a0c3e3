"""The plugin's contact points with whichever vLLM is installed (0.32 in CI, 0.26 on the device)."""

import contextlib
import logging

import torch

from vllm_dsv4 import compat, plugin
from vllm_dsv4.ops import vllm_kernels


def test_register_is_idempotent_and_overrides_the_in_tree_architecture():
    from vllm import ModelRegistry

    plugin.register()
    plugin.register()
    entry = ModelRegistry.models["DeepseekV4ForCausalLM"]
    assert (entry.module_name, entry.class_name) == ("vllm_dsv4.model.decoder", "DeepseekV4ForCausalLM")


@contextlib.contextmanager
def vllm_log_messages():
    """The messages that reach vLLM's ``vllm`` logger (at INFO and above) while the block runs."""

    class Collect(logging.Handler):
        def __init__(self):
            super().__init__()
            self.messages = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    vllm_logger, handler = logging.getLogger("vllm"), Collect()
    level = vllm_logger.level
    vllm_logger.addHandler(handler)
    vllm_logger.setLevel(logging.INFO)
    try:
        yield handler.messages
    finally:
        vllm_logger.removeHandler(handler)
        vllm_logger.setLevel(level)


def test_our_logs_go_through_vllms_logger():
    """vLLM configures only its ``vllm`` logger (handlers, level): ours must sit under it, or Python's
    last-resort handler takes our records and drops INFO (the warm-up's step timings never printed)."""
    from vllm_dsv4 import warmup

    with vllm_log_messages() as messages:
        warmup.logger.info("warm-up took %.1f s", 1.5)
    assert messages == ["warm-up took 1.5 s"]


def test_a_binding_warning_prints_once_per_message():
    with vllm_log_messages() as messages:
        for _ in range(3):  # as every layer's linears of one shape bind
            vllm_kernels._warn_once("no vLLM block-FP8 kernel for (64, 64) (test)")
        vllm_kernels._warn_once("no vLLM block-FP8 kernel for (128, 64) (test)")
    assert messages == ["vllm-dsv4: no vLLM block-FP8 kernel for (64, 64) (test)",
                        "vllm-dsv4: no vLLM block-FP8 kernel for (128, 64) (test)"]


def test_official_fp8_checkpoint_is_claimed_by_the_plugin_not_the_in_tree_layers():
    from vllm_dsv4.loader.quant_config import NAME, Dsv4CheckpointQuantConfig

    class HfConfig:
        model_type = "deepseek_v4"

    official = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    assert Dsv4CheckpointQuantConfig.override_quantization_method(official, None, HfConfig()) == NAME
    HfConfig.model_type = "llama"
    assert Dsv4CheckpointQuantConfig.override_quantization_method(official, None, HfConfig()) is None


def test_spec_adapters_state_tokens_per_entry_and_window():
    compressed = compat.compressed_spec(block_size=256, entry_dim=512, dtype=torch.bfloat16, tokens_per_entry=4)
    window = compat.window_spec(block_size=64, entry_dim=512, dtype=torch.bfloat16, window_tokens=128)
    assert compressed.page_size_bytes == 64 * 512 * 2
    assert window.page_size_bytes == 64 * 512 * 2 and window.sliding_window == 128
    field = "compress_ratio" if compat.is_vllm_026() else "tokens_per_state"
    assert getattr(compressed, field) == 4


def kv_transfer(connector: str, *children: str):
    from vllm.config import KVTransferConfig

    extra = {"connectors": [{"kv_connector": c, "kv_role": "kv_both"} for c in children]} if children else {}
    return KVTransferConfig(kv_connector=connector, kv_role="kv_both", kv_connector_extra_config=extra)


def test_vllms_own_pull_nixl_connector_is_refused_where_it_reads_pages_at_the_wrong_length(monkeypatch):
    import pytest

    from vllm_dsv4.config import ConfigError

    for config in (kv_transfer("NixlConnector"), kv_transfer("NixlPullConnector"),
                   kv_transfer("MultiConnector", "DSV4Connector", "NixlConnector")):
        with pytest.raises(ConfigError, match="DSV4NixlConnector"):
            compat.refuse_address_keyed_nixl(config)
    for config in (None, kv_transfer("DSV4NixlConnector"), kv_transfer("MultiConnector", "DSV4NixlConnector")):
        compat.refuse_address_keyed_nixl(config)
    monkeypatch.setattr(compat, "is_vllm_026", lambda: True)  # whole rows there: vLLM's own is right
    compat.refuse_address_keyed_nixl(kv_transfer("NixlConnector"))


def test_the_plugin_registers_its_nixl_connector():
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from vllm_dsv4.connector.nixl import DSV4NixlConnector

    plugin.register()
    assert KVConnectorFactory.get_connector_class(kv_transfer("DSV4NixlConnector")) is DSV4NixlConnector
