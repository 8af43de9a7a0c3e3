"""One attention backend for every DSV4 cache component, and its per-step metadata builder.

DSV4 layers run their own forward (model/attention.py), so the backend only names the component
caches to vLLM, asks for a block-outermost layout (so components with different page sizes pack
into one block pool, vllm_plugin_surface.md §2.4) and builds the step metadata below.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    MultipleOf,
)


@dataclass(frozen=True)
class CacheStepMetadata:
    """Where one cache component's entries live in this step. R requests, T tokens.

    ``block_table`` [R, max_blocks] is this component's KV-cache group's; the rest is shared by all
    groups. Device tensors are views of buffers that keep their address from step to step, which is
    what a captured CUDA graph replays against.
    """

    block_table: torch.Tensor
    token_to_req: torch.Tensor  # [T] int64 on the device, -1 for padding tokens
    decode_only: bool  # no request has more query tokens than a decode step's (1 + draft tokens): the
    # fixed-shape (CUDA-graph) path, which computes any step's tokens alike, each from its own position
    max_seq_len: int  # the longest request's tokens up to this step's last (host): widths without a device read
    query_starts: list[int]  # [R + 1] where each request's tokens start in the step (host)
    seq_len_bounds: list[int] | None  # [R] at least each request's tokens up to this step's last (host;
    # not in decode steps, which do not read it)
    # This step's plans: FlashMLA's, one per (query chunk, layer kind), and the index tensors every
    # layer of a kind would otherwise recompute (model/attention.py, compressor.py, indexer.py); one
    # dict per step, shared by every cache group's metadata (StepPlans), so a plan never outlives the
    # step (or the graph capture) it was made in.
    plans: dict = field(default_factory=dict, compare=False)

    def once(self, key, make: Callable[[], Any]) -> Any:
        """``make()`` for the first layer of this step that asks for ``key``, kept in ``plans`` and
        returned as it is to every later one."""
        if key not in self.plans:
            self.plans[key] = make()
        return self.plans[key]


class TokenRequests:
    """``token_to_req`` in one device buffer per device shared by every cache group's builder (and the
    draft model's): the map is a function of the step's query layout alone, so it is written only when
    that differs from what the buffer holds (the builders of one step, and decode steps of an unchanged
    batch, write nothing). Its address stays fixed: CUDA graphs replay against it. Writes are ordered
    on the stream after the work of earlier steps that reads it."""

    _by_device: dict[tuple[str, int], TokenRequests] = {}

    def __init__(self, max_tokens: int, device):
        self.buffer = torch.full((max_tokens,), -1, dtype=torch.int64, device=device)
        self.holds = None  # (starts, num_tokens) of the map the buffer holds

    @classmethod
    def shared(cls, max_tokens: int, device) -> TokenRequests:
        key = (str(torch.device(device)), max_tokens)
        if key not in cls._by_device:
            cls._by_device[key] = cls(max_tokens, device)
        return cls._by_device[key]

    def of(self, starts: list[int], num_tokens: int) -> torch.Tensor:
        """``[num_tokens]``: the request each token belongs to (request r's start at ``starts[r]``), -1
        for the padding after the last one."""
        if self.holds != (starts, num_tokens):
            token_to_req = torch.full((num_tokens,), -1, dtype=torch.int64)
            token_to_req[: starts[-1]] = torch.repeat_interleave(torch.arange(len(starts) - 1),
                                                                 torch.tensor(starts).diff())
            self.buffer[:num_tokens].copy_(token_to_req, non_blocking=True)
            self.holds = (starts, num_tokens)
        return self.buffer[:num_tokens]


class StepPlans:
    """What the metadata of every cache group of one step shares, made by the step's first group: the
    ``plans`` dict, so that a plan is made once per step and layer kind rather than once per group
    (vLLM splits the layers' caches into groups of a few layers, a window group per two layers at
    V4-Flash, and FlashMLA's scheduler plan alone took 27 us per layer and step on the H200: 2026-12-05
    decode profile, one per layer), and the step's fields (token map, query starts, bounds: the 17
    groups of a 6-layer step took 185 us to build on a 2-core CPU with each working them out, 119
    without). vLLM builds each group's metadata from a shallow copy of one ``CommonAttentionMetadata``
    per step, so the groups of a step hand in the same ``query_start_loc_cpu`` tensor, a new slice
    every step, which marks the step (held here, so its id cannot be reused by another)."""

    _by_device: dict[str, StepPlans] = {}

    def __init__(self):
        self.step = None  # the marker of the step whose plans are held
        self.plans: dict = {}
        self.fields: dict = {}

    @classmethod
    def shared(cls, device) -> StepPlans:
        return cls._by_device.setdefault(str(torch.device(device)), cls())

    def of(self, step: torch.Tensor, make_fields: Callable[[], dict]) -> tuple[dict, dict]:
        """``(plans, fields)`` of the step that ``step`` (its ``query_start_loc_cpu``) marks: for a new
        step, an empty plans dict and ``make_fields()``."""
        if step is not self.step:
            self.step, self.plans, self.fields = step, {}, make_fields()
        return self.plans, self.fields


class CacheMetadataBuilder(AttentionMetadataBuilder[CacheStepMetadata]):
    # Full CUDA graphs of decode steps, also where each request verifies draft tokens (speculative
    # decoding: 1 + k query tokens each): the decode path has fixed shapes and no host syncs.
    _cudagraph_support = AttentionCGSupport.UNIFORM_BATCH

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._token_requests = TokenRequests.shared(vllm_config.scheduler_config.max_num_batched_tokens, device)
        self._step_plans = StepPlans.shared(device)
        spec = vllm_config.speculative_config
        self._decode_query_len = 1 + (spec.num_speculative_tokens if spec is not None else 0)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False):
        """``fast_build``: a draft step (vLLM's ``build_for_drafting``), whose proposer reuses one
        ``CommonAttentionMetadata`` for all its draft steps: its plans are its own."""
        cm = common_attn_metadata
        if fast_build:
            plans, fields = {}, self._step_fields(cm)
        else:
            plans, fields = self._step_plans.of(cm.query_start_loc_cpu, lambda: self._step_fields(cm))
        return CacheStepMetadata(block_table=cm.block_table_tensor[: cm.num_reqs], plans=plans, **fields)

    def _step_fields(self, cm: CommonAttentionMetadata) -> dict:
        """The fields of ``CacheStepMetadata`` that are the same for every cache group of a step."""
        starts = cm.query_start_loc_cpu[: cm.num_reqs + 1].tolist()
        decode_only = cm.max_query_len <= self._decode_query_len
        bounds = None if decode_only else cm.seq_lens_cpu_upper_bound  # read by other steps only
        return dict(
            token_to_req=self._token_requests.of(starts, cm.num_actual_tokens),
            decode_only=decode_only,
            max_seq_len=cm.max_seq_len,
            query_starts=starts,
            seq_len_bounds=None if bounds is None else bounds[: cm.num_reqs].tolist(),
        )


class CacheBackend(AttentionBackend):
    """Backend of every DSV4 cache component (names other registries see carry our prefix)."""

    @staticmethod
    def get_name() -> str:
        return "DSV4_PLUGIN_CACHE"

    @staticmethod
    def get_impl_cls():
        raise NotImplementedError("DSV4 cache layers run their own forward; there is no impl")

    @staticmethod
    def get_builder_cls():
        return CacheMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None):
        return [MultipleOf(1)]

    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str="auto"):
        # vLLM 0.26 only (compat ledger 3): one latent entry per token slot.
        return (num_blocks, block_size, head_size)

    @classmethod
    def supported_kv_cache_layouts(cls):
        from vllm.v1.kv_cache_layout import KVCacheLayout

        return (KVCacheLayout.BLHNC,)
