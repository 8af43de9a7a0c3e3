"""vLLM general-plugin entry point (``vllm.general_plugins`` -> ``vllm_dsv4``).

vLLM calls ``register()`` once in every process it starts (front end, registry inspection,
engine core, workers), so it is idempotent, imports nothing heavy and touches no device. It registers
the models, the quantisation config, the KV connector and the serving names, and applies every patch
of vLLM (patches.py).
"""

from __future__ import annotations

_registered = False

MODEL_CLASSES = {
    "DeepseekV4ForCausalLM": "vllm_dsv4.model.decoder:DeepseekV4ForCausalLM",
    # a checkpoint with a vision tower (patches.py patch 9 names it so on vLLM 0.26 too)
    "DeepseekV4ForConditionalGeneration": "vllm_dsv4.vision.model:DeepseekV4ForConditionalGeneration",
    "DeepSeekV4MTPModel": "vllm_dsv4.model.mtp:DeepseekV4MTP",  # the name vLLM's "mtp" method asks for
    "DSparkDraftModel": "vllm_dsv4.model.dspark:DeepseekV4DSpark",  # and its "dspark" method
}


# --kv-transfer-config '{"kv_connector": "DSV4Connector", ...}' (vllm_dsv4/connector/connector.py),
# '{"kv_connector": "DSV4NixlConnector", ...}' (vllm_dsv4/connector/nixl.py)
CONNECTORS = (("DSV4Connector", "vllm_dsv4.connector.connector", "DSV4Connector"),
              ("DSV4NixlConnector", "vllm_dsv4.connector.nixl", "DSV4NixlConnector"))


def register() -> None:
    global _registered
    if _registered:
        return
    from vllm import ModelRegistry

    from vllm_dsv4 import compat, patches

    compat.check_supported_version()
    _jit_cache_under_vllm_root()
    from vllm.model_executor.layers.quantization import register_quantization_config

    from vllm_dsv4.loader.quant_config import NAME, Dsv4CheckpointQuantConfig

    register_quantization_config(NAME)(Dsv4CheckpointQuantConfig)
    for arch, target in MODEL_CLASSES.items():
        ModelRegistry.register_model(arch, target)  # replaces the in-tree class of the same name
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    for connector in CONNECTORS:
        if connector[0] not in KVConnectorFactory._registry:  # registered once per process
            KVConnectorFactory.register_connector(*connector)
    patches.apply(warm_up_kernels, dspark_proposer)
    from vllm_dsv4 import serving

    serving.register()
    _registered = True


def warm_up_kernels(model_runner) -> None:
    """patches.py's patch 4 runs this on a runner of our model: warmup.py's steps (imported here, in the
    worker, when it first runs: it imports the model)."""
    from vllm_dsv4.warmup import warm_up_kernels as run

    run(model_runner)


def _jit_cache_under_vllm_root() -> None:
    """Triton's compiled kernels (ours and vLLM's) under vLLM's cache root, beside DeepGEMM's, unless
    ``TRITON_CACHE_DIR`` names a folder: one folder (``VLLM_CACHE_ROOT``) to keep for warm starts on
    any machine. Every process calls this before its first compile (workers inherit the variable)."""
    import os

    from vllm_dsv4 import envs

    os.environ.setdefault(envs.TRITON_CACHE_DIR.name, os.path.join(envs.VLLM_CACHE_ROOT.read(), "triton"))


def dspark_proposer() -> type:
    """patches.py's patch 6 builds this proposer where vLLM's V1 runner drafts with DSpark (imported in the
    worker, when first needed)."""
    from vllm_dsv4.spec_decode.dspark import DSparkProposer

    return DSparkProposer
