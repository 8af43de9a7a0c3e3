"""Where each cache component's entries live in a step, and what the step's layers share: the
per-step metadata (``CacheStepMetadata``, with its ``StepPlan``) and the builder vLLM runs once per
KV-cache group and step (``CacheMetadataBuilder``, named by kv/backend.py's ``CacheBackend``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.v1.attention.backend import AttentionCGSupport, AttentionMetadataBuilder, CommonAttentionMetadata


class Memo(dict):
    """A dict whose values are each made once: ``once(key, make)``."""

    def once(self, key, make: Callable[[], Any]) -> Any:
        """``make()`` for the first caller that asks for ``key``; that value, as it is, for every later one."""
        if key not in self:
            self[key] = make()
        return self[key]


@dataclass
class StepPlan:
    """What depends only on the step's tokens, made by the first layer that needs it and read by every
    later one (a CUDA graph captures the first layer's computation). One per step, shared by every
    cache group's metadata (``StepPlans``), so a plan never outlives the step or the graph capture it
    was made in; a draft step has its own. Keys: a layer kind (``config.LayerKind``), the rows
    ``(start, stop)`` of a query chunk of the step, or both."""

    closed_windows: Memo = field(default_factory=Memo)  # kind -> model.compressor.ClosedWindows
    visible_entries: Memo = field(default_factory=Memo)  # kind -> (num_visible [T], width): compressor.py
    window_entries: Memo = field(default_factory=Memo)  # chunk -> [t, W] window slots of its queries
    c128_entries: Memo = field(default_factory=Memo)  # chunk -> [t, K] every visible C128 entry, then -1
    # () -> [T, W'] a prefill step's window slots widened inside image blocks (model/image_window.py), or None
    image_window: Memo = field(default_factory=Memo)
    span_rows: Memo = field(default_factory=Memo)  # (chunk, kind) -> host bounds on a prefill call's key rows
    # (chunk, kind) -> the scratch dict the attention calls of the chunk's layers of that kind share
    # (csrc_triton.paged.CacheSource.plans: their slot lists have the same lengths)
    call_scratch: Memo = field(default_factory=Memo)


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
    plan: StepPlan = field(default_factory=StepPlan, compare=False)  # what the step's layers share


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
    ``StepPlan``, so that a plan is made once per step and layer kind rather than once per group (vLLM
    splits the layers' caches into groups of a few layers, a window group per two layers at V4-Flash,
    and a plan made per group would be made once per layer), and the step's fields (token map, query
    starts, bounds), worked out once rather than by every group's builder. vLLM builds each group's
    metadata from a shallow copy of one ``CommonAttentionMetadata`` per step, so the groups of a step
    hand in the same ``query_start_loc_cpu`` tensor, a new slice every step, which marks the step
    (held here, so its id cannot be reused by another)."""

    _by_device: dict[str, StepPlans] = {}

    def __init__(self):
        self.step = None  # the marker of the step whose plan is held
        self.plan = StepPlan()
        self.fields: dict = {}

    @classmethod
    def shared(cls, device) -> StepPlans:
        return cls._by_device.setdefault(str(torch.device(device)), cls())

    def of(self, step: torch.Tensor, make_fields: Callable[[], dict]) -> tuple[StepPlan, dict]:
        """``(plan, fields)`` of the step that ``step`` (its ``query_start_loc_cpu``) marks: for a new
        step, an empty plan and ``make_fields()``."""
        if step is not self.step:
            self.step, self.plan, self.fields = step, StepPlan(), make_fields()
        return self.plan, self.fields


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
        ``CommonAttentionMetadata`` for all its draft steps: its plan is its own."""
        cm = common_attn_metadata
        if fast_build:
            plan, fields = StepPlan(), self._step_fields(cm)
        else:
            plan, fields = self._step_plans.of(cm.query_start_loc_cpu, lambda: self._step_fields(cm))
        return CacheStepMetadata(block_table=cm.block_table_tensor[: cm.num_reqs], plan=plan, **fields)

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
