"""``DSV4Connector``: vLLM KV connector that moves every DeepSeek-V4 cache component of a prefix
between engines and an entry store (:mod:`.store`): prefill/decode disaggregation through a shared
store, and CPU (tmpfs) or disk offload of prefixes that outlive the GPU's prefix cache.

    --kv-transfer-config '{"kv_connector": "DSV4Connector", "kv_role": "kv_both",
                           "kv_connector_extra_config": {"path": "/dev/shm/dsv4-kv", "max_bytes": 64e9}}'

``kv_producer`` engines save, ``kv_consumer`` engines load, ``kv_both`` do both;
``window_every`` (tokens, default 8192) spaces the window entries of a prompt (:mod:`.plan`). The
scheduler side decides from the token ids which entries a step completes (:func:`.plan.save_ends`) and
where a new request can resume (:func:`.plan.resume_point`); the worker side copies whole cache
pages of every group by block id: no per-layer hooks, which DeepSeek-V4's own attention never calls.
Saves are written after the step's forward (``wait_for_save``), so a request's prompt entries are in
the store before its output is; what it generated, in the step after it finishes (vLLM holds its blocks
until the worker reports them written). Loads are asynchronous in vLLM's sense (the request waits one step for
them) because that is where vLLM takes per-request load failures for models with several KV-cache
groups: an entry that is missing or fails its checksum when the worker reads it fails that request's
load, which vLLM then recomputes or fails (``kv_load_failure_policy``) while serving the others.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

from vllm_dsv4 import compat, get_logger
from vllm_dsv4.config import ConfigError, Dsv4Config
from vllm_dsv4.connector.plan import (
    Group,
    PrefixKeys,
    chunk_tokens,
    finish_ends,
    history_ends,
    history_positions,
    loaded_window_positions,
    resume_point,
    save_ends,
    window_positions,
)
from vllm_dsv4.connector.store import EntryError, EntryStore
from vllm_dsv4.kv.layout import component_of_layer

logger = get_logger(__name__)

FORMAT = 1
DEFAULT_WINDOW_EVERY = 8192  # tokens between the window entries of a prompt (module plan.py)
NULL_BLOCK = 0  # vLLM's placeholder block id (window blocks out of the window); never read or written


@dataclass
class Save:
    """One entry to write: the block ids of its stored positions, per group; ``releases`` the finished
    request whose blocks vLLM holds until this (its last) entry is written."""

    end: int
    key: str
    block_ids: list[list[int]]
    releases: str | None = None


@dataclass
class Load:
    """One entry to read into a request: per group, (offset within the entry's pages, destination block)."""

    end: int
    key: str
    copies: list[list[tuple[int, int]]]


@dataclass
class DSV4ConnectorMetadata(KVConnectorMetadata):
    saves: list[Save] = field(default_factory=list)
    loads: dict[str, list[Load]] = field(default_factory=dict)  # request id -> its entries


@dataclass
class _Request:
    """Scheduler-side state of one request."""

    prompt: Any  # its prompt token ids (the steps' saves stay within them; see request_finished_all_groups)
    keys: PrefixKeys
    block_ids: list[list[int]] = field(default_factory=list)
    lookup: tuple[int, int] | None = None  # (tokens it had, tokens after the load) of its last lookup


@dataclass(frozen=True)
class Options:
    """``kv_connector_extra_config``."""

    path: str  # the entry store's directory
    max_bytes: int | None = None  # the store's budget; least recently used entries go past it
    window_every: int = DEFAULT_WINDOW_EVERY  # tokens between a prompt's window entries
    model_key: str | None = None  # names the model in keys instead of its path

    @classmethod
    def parse(cls, extra: dict[str, Any]) -> "Options":
        known = set(cls.__dataclass_fields__)
        if "path" not in extra or set(extra) - known:
            unknown = sorted(set(extra) - known)
            raise ConfigError(f"DSV4Connector: kv_connector_extra_config takes {sorted(known)} ('path' required: "
                              f"a tmpfs such as /dev/shm/... for CPU memory, or a disk or shared directory)"
                              + (f"; unknown: {unknown}" if unknown else ""))
        try:
            max_bytes = int(float(extra["max_bytes"])) if extra.get("max_bytes") is not None else None
            window_every = int(extra.get("window_every", DEFAULT_WINDOW_EVERY))
        except (TypeError, ValueError) as e:
            raise ConfigError(f"DSV4Connector: max_bytes and window_every are numbers ({e})") from e
        if (max_bytes is not None and max_bytes <= 0) or window_every <= 0:
            raise ConfigError(f"DSV4Connector: max_bytes={max_bytes} and window_every={window_every} must be > 0")
        return cls(str(extra["path"]), max_bytes, window_every, extra.get("model_key"))


class DSV4Connector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        if kv_cache_config is None:
            raise ConfigError("DSV4Connector needs vLLM's KV-cache configuration (vLLM >= 0.26)")
        transfer = vllm_config.kv_transfer_config
        options = Options.parse(transfer.kv_connector_extra_config or {})
        try:
            self.store = EntryStore(options.path, options.max_bytes)
        except OSError as e:
            raise ConfigError(f"DSV4Connector: cannot use {options.path!r} as the entry store ({e})") from e
        self.saves, self.loads = transfer.is_kv_producer, transfer.is_kv_consumer
        cfg = Dsv4Config.from_hf_config(vllm_config.model_config.hf_config)
        self.groups = [
            Group(g.kv_cache_spec.block_size, tuple(g.layer_names),
                  tuple(component_of_layer(cfg, name, g.kv_cache_spec.block_size) for name in g.layer_names))
            for g in kv_cache_config.kv_cache_groups
        ]
        self.chunk = chunk_tokens(self.groups)
        self.window_every = options.window_every
        if self.window_every % self.chunk:
            raise ConfigError(f"DSV4Connector: window_every={self.window_every} must be a multiple of "
                              f"{self.chunk} tokens (the KV-cache block)")
        self.fingerprint = _fingerprint(vllm_config, kv_cache_config, options.model_key)
        # scheduler side
        self._requests: dict[str, _Request] = {}
        self._pending_loads: dict[str, list[Load]] = {}
        self._finish_saves: list[Save] = []
        # worker side
        self._pages: dict[str, torch.Tensor] = {}
        self._done_loading: set[str] = set()
        self._done_saving: set[str] = set()
        self._failed_loading: set[str] = set()

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        if not self.loads or num_computed_tokens % self.chunk:
            return 0, False
        r = self._track(request)
        tokens = request.all_token_ids

        def window_ends(boundary: int):
            for name in self.store.list(r.keys.window_dir(tokens, boundary)):
                end = PrefixKeys.window_end(boundary, name)  # the key's hash must be of this request's tokens
                if end <= len(tokens) and r.keys.window_key(tokens, end) == name and self.store.check(name):
                    yield end

        end = resume_point(num_computed_tokens, request.num_tokens, self.chunk,
                           lambda h: self.store.check(r.keys.history_key(tokens, h)), window_ends)
        r.lookup = (num_computed_tokens, end)
        return end - num_computed_tokens, end > num_computed_tokens

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        r = self._track(request)
        if num_external_tokens == 0:
            return
        start, end = r.lookup
        if start + num_external_tokens != end:  # never expected: vLLM trimmed the hit we reported
            logger.error("DSV4Connector: request %s was given %d external tokens after %d, not the %d its "
                         "entries hold; its load fails", request.request_id, num_external_tokens, start, end - start)
            self._pending_loads[request.request_id] = []
            return
        ids = blocks.get_block_ids()
        tokens = request.all_token_ids
        loads = []
        for h in history_ends(start, end, self.chunk):
            loads.append(Load(h, r.keys.history_key(tokens, h), [
                [(i, group_ids[p]) for i, p in enumerate(history_positions(group, h, self.chunk))]
                for group, group_ids in zip(self.groups, ids)]))
        copies = []
        for group, group_ids in zip(self.groups, ids):
            first = window_positions(group, end, self.chunk).start
            copies.append([(p - first, group_ids[p]) for p in loaded_window_positions(group, start, end, self.chunk)
                           if group_ids[p] != NULL_BLOCK])
        loads.append(Load(end, r.keys.window_key(tokens, end), copies))
        self._pending_loads[request.request_id] = loads

    def build_connector_meta(self, scheduler_output) -> DSV4ConnectorMetadata:
        meta = DSV4ConnectorMetadata(saves=self._finish_saves, loads=self._pending_loads)
        self._pending_loads, self._finish_saves = {}, []
        if not self.saves:
            return meta
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            r = self._requests.get(new.req_id)
            if r is not None:
                r.block_ids = [list(ids) for ids in new.block_ids]
                self._plan_saves(meta, r, new.num_computed_tokens, scheduled[new.req_id])
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            r = self._requests.get(req_id)
            if r is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                r.block_ids = [list(ids) for ids in new_ids]
            elif new_ids is not None:
                for ids, more in zip(r.block_ids, new_ids):
                    ids.extend(more)
            self._plan_saves(meta, r, cached.num_computed_tokens[i], scheduled[req_id])
        return meta

    def request_finished_all_groups(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        """Prompt entries were written in the steps that computed them; what the request generated is
        written in the next step, vLLM holding its blocks until then."""
        r = self._requests.pop(request.request_id, None)
        if not self.saves or r is None:
            return False, None
        computed = min(request.num_computed_tokens, len(request.all_token_ids) - 1)
        history, windows = finish_ends(len(r.prompt), computed, self.chunk)
        saves = self._saves(r.keys, request.all_token_ids, history, windows, [list(ids) for ids in block_ids])
        if not saves:
            return False, None
        saves[-1].releases = request.request_id
        self._finish_saves += saves
        return True, None

    def _track(self, request) -> _Request:
        r = self._requests.get(request.request_id)
        if r is None:
            salt = self.fingerprint + (getattr(request, "cache_salt", None) or "").encode()
            r = self._requests[request.request_id] = _Request(request.prompt_token_ids, PrefixKeys(salt, self.chunk))
        return r

    def _plan_saves(self, meta: DSV4ConnectorMetadata, r: _Request, computed: int, scheduled: int) -> None:
        history, windows = save_ends(computed, computed + scheduled, len(r.prompt), self.chunk, self.window_every)
        meta.saves += self._saves(r.keys, r.prompt, history, windows, r.block_ids)

    def _saves(self, keys: PrefixKeys, tokens, history: list[int], windows: list[int],
               block_ids: list[list[int]]) -> list[Save]:
        """The entries not yet stored among the history and window entries at these ends."""
        saves = []
        for ends, key_of, positions in ((history, keys.history_key, history_positions),
                                        (windows, keys.window_key, window_positions)):
            for e in ends:
                key = key_of(tokens, e)
                if not self.store.contains(key):
                    saves.append(Save(e, key, [[ids[p] for p in positions(group, e, self.chunk)]
                                               for group, ids in zip(self.groups, block_ids)]))
        return saves

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        missing = [name for g in self.groups for name in g.layers if name not in kv_caches]
        if missing:
            raise ConfigError(f"DSV4Connector: vLLM registered no cache for {missing[:3]}")
        # pages as bytes [num_blocks, page bytes]: what is stored does not depend on the cache dtype
        self._pages = {}
        for name in (name for g in self.groups for name in g.layers):
            view = compat.cache_view(kv_caches[name]).view(torch.uint8)
            self._pages[name] = view.view(view.shape[0], -1)  # a view of the cache, never a copy

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        for req_id, loads in meta.loads.items():
            try:
                if not loads:
                    raise EntryError("no entry holds the tokens vLLM counted as loaded")
                for load in loads:
                    self._load(load)
            except EntryError as e:
                logger.error("DSV4Connector: KV load for request %s failed: %s", req_id, e)
                self._failed_loading.add(req_id)
            self._done_loading.add(req_id)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are whole pages before the step that uses them

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return  # saves are whole pages after the forward (wait_for_save)

    def wait_for_save(self) -> None:
        writes = get_tensor_model_parallel_rank() == 0  # every rank holds the same (replicated) cache
        for save in self._get_connector_metadata().saves:
            try:
                if writes:
                    self._save(save)
            except OSError as e:  # a full or read-only store: later requests recompute this prefix
                logger.error("DSV4Connector: could not save KV entry %s (%s)", self.store.path(save.key), e)
            if save.releases is not None:
                self._done_saving.add(save.releases)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        loaded, self._done_loading = self._done_loading, set()
        saved, self._done_saving = self._done_saving, set()
        if self._failed_loading and not compat.reports_failed_loads():
            raise EntryError(f"KV loads failed for {sorted(self._failed_loading)} and this vLLM has no way to "
                             "recompute them (see the errors above)")
        return saved or None, loaded or None

    def get_transfer_results(self, finished_req_ids: set[str]):
        failed, self._failed_loading = self._failed_loading, set()
        saved, loaded = self.get_finished(finished_req_ids)
        return compat.kv_transfer_results(finished_sending=saved or set(), finished_recving=loaded or set(),
                                          failed_recving=failed)

    def _save(self, save: Save) -> None:
        """One gather and one device-to-host copy per group (its layers' pages one after another)."""
        parts, groups = [], []
        for group, ids in zip(self.groups, save.block_ids):
            layers = [self._pages[name] for name in group.layers]
            index = torch.tensor(ids, dtype=torch.long, device=layers[0].device)
            parts.append(torch.cat([pages.index_select(0, index).flatten() for pages in layers]).cpu().numpy())
            groups.append({"blocks": len(ids), "layers": list(group.layers),
                           "page_bytes": [pages.shape[1] for pages in layers]})
        header = {"format": FORMAT, "fingerprint": self.fingerprint.hex(), "end": save.end, "groups": groups}
        self.store.write(save.key, header, parts)

    def _load(self, load: Load) -> None:
        try:
            self._copy_in(load, *self.store.read(load.key))
        except (EntryError, KeyError, TypeError, ValueError, RuntimeError) as e:
            self.store.discard(load.key)  # computed and saved again by the request that now recomputes it
            if isinstance(e, EntryError):
                raise
            raise EntryError(f"KV entry {self.store.path(load.key)} does not match its header ({e!r})") from e

    def _copy_in(self, load: Load, header: dict, payload: memoryview) -> None:
        if header.get("format") != FORMAT or header.get("fingerprint") != self.fingerprint.hex():
            raise EntryError(f"KV entry {self.store.path(load.key)} was written for another model or cache layout")
        if header["end"] != load.end or len(header["groups"]) != len(self.groups):
            raise EntryError(f"KV entry {self.store.path(load.key)} holds another resume point")
        data = torch.frombuffer(payload, dtype=torch.uint8) if payload.nbytes else torch.empty(0, dtype=torch.uint8)
        data = data.to(next(iter(self._pages.values())).device)  # one host-to-device copy per entry
        offset = 0
        for group, stored, copies in zip(self.groups, header["groups"], load.copies):
            if stored["layers"] != list(group.layers):
                raise EntryError(f"KV entry {self.store.path(load.key)} has other cache layers")
            src = torch.tensor([s for s, _ in copies], dtype=torch.long, device=data.device)
            dst = torch.tensor([d for _, d in copies], dtype=torch.long, device=data.device)
            for name, page_bytes in zip(group.layers, stored["page_bytes"]):
                pages = self._pages[name]
                size = stored["blocks"] * page_bytes
                if page_bytes != pages.shape[1] or (copies and max(s for s, _ in copies) >= stored["blocks"]):
                    raise EntryError(f"KV entry {self.store.path(load.key)}: pages of {name} do not fit this cache")
                if copies:
                    block = data[offset:offset + size].view(stored["blocks"], page_bytes)
                    pages[dst] = block[src]
                offset += size


def _fingerprint(vllm_config, kv_cache_config, model_key: str | None) -> bytes:
    """What makes two engines' entries interchangeable: the model, its dtype and every cache layer's page."""
    model_config = vllm_config.model_config
    description = {
        "format": FORMAT,
        "model": model_key or model_config.model,
        "dtype": str(model_config.dtype),
        "cache_dtype": vllm_config.cache_config.cache_dtype,
        "groups": [[g.kv_cache_spec.block_size, g.kv_cache_spec.page_size_bytes, list(g.layer_names)]
                   for g in kv_cache_config.kv_cache_groups],
    }
    return hashlib.blake2b(json.dumps(description, sort_keys=True).encode(), digest_size=16).digest()
