"""``DSV4Connector``: vLLM KV connector that moves every DeepSeek-V4 cache component of a prefix
between engines and an entry store (:mod:`.store`): prefill/decode disaggregation through a shared
store, and CPU (tmpfs) or disk offload of prefixes that outlive the GPU's prefix cache.

    --kv-transfer-config '{"kv_connector": "DSV4Connector", "kv_role": "kv_both",
                           "kv_connector_extra_config": {"path": "/dev/shm/dsv4-kv", "max_bytes": 64e9}}'

``kv_producer`` engines save, ``kv_consumer`` engines load, ``kv_both`` do both; the other options
are listed in :mod:`.options` (``window_every`` spaces the window entries of a prompt, :mod:`.plan`). The
scheduler side decides from the token ids which entries a step completes (:func:`.plan.save_ends`) and
where a new request can resume (:func:`.plan.resume_point`); the worker side copies whole cache
pages of every group by block id: no per-layer hooks, which DeepSeek-V4's own attention never calls.
Saves are written after the step's forward (``wait_for_save``), so a request's prompt entries are in
the store before its output is; what it generated, in the step after it finishes (vLLM holds its blocks
until the worker reports them written). Loads are asynchronous in vLLM's sense (the request waits one step for
them) because that is where vLLM takes per-request load failures for models with several KV-cache
groups: an entry that is missing or fails its checksum when the worker reads it fails that request's
load, which vLLM then recomputes or fails (``kv_load_failure_policy``) while serving the others.
Where vLLM cannot do that (0.26), lookups pin verified copies of the entries instead (:mod:`.lookup`),
so that no store event (an entry evicted, replaced or damaged by another engine) fails a load late.
The scheduler's store I/O runs with a time bound, so that a hung store only costs misses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
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
    arrived_history_ends,
    chunk_tokens,
    finish_ends,
    history_ends,
    history_positions,
    loaded_window_positions,
    resume_point,
    save_ends,
    window_positions,
)
from vllm_dsv4.connector.fingerprint import FORMAT, fingerprint
from vllm_dsv4.connector.lookup import BoundedCalls, Pins
from vllm_dsv4.connector.options import Options
from vllm_dsv4.connector.store import Access, EntryError, EntryStore, UnsafeStoreError, read_entry
from vllm_dsv4.kv.layout import component_of_layer

logger = get_logger(__name__)

MAX_PIN_RETRIES = 4  # lookups redone after a damaged entry is dropped, before the request just misses
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
    """One entry to read into a request: per group, (offset within the entry's pages, destination block);
    ``pin``: the file of its verified copy (:class:`.lookup.Pins`), None to read the store."""

    end: int
    key: str
    copies: list[list[tuple[int, int]]]
    pin: str | None = None


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
    pins: dict[str, str] = field(default_factory=dict)  # key -> pinned copy, for the last lookup's entries


class DSV4Connector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        if kv_cache_config is None:
            raise ConfigError("DSV4Connector needs vLLM's KV-cache configuration (vLLM >= 0.26)")
        transfer = vllm_config.kv_transfer_config
        options = Options.parse(transfer.kv_connector_extra_config or {})
        try:
            self.store = EntryStore(options.path, options.max_bytes, options.secret, Access(options.group))
        except (OSError, UnsafeStoreError) as e:
            raise ConfigError(f"DSV4Connector: cannot use {options.path!r} as the entry store ({e})") from e
        if role == KVConnectorRole.SCHEDULER:
            logger.info("DSV4Connector: entry store %s, budget %.3g GB%s", options.path, self.store.max_bytes / 1e9,
                        "" if options.max_bytes else " (half its filesystem's free space; set max_bytes to choose)")
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
        self.fingerprint = fingerprint(vllm_config, kv_cache_config, options.model_key, options.secret)
        # scheduler side
        self.lookups = BoundedCalls(options.lookup_timeout_s)
        pin = options.pin_loads if options.pin_loads is not None else not compat.reports_failed_loads()
        self.pins = Pins(self.store) if pin and self.loads and role == KVConnectorRole.SCHEDULER else None
        self._awaiting_load: set[str] = set()  # requests whose loads went to the workers
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
        tokens = list(request.all_token_ids)  # a copy: a lookup that times out may still be reading it
        pinned = r.pins
        end, r.pins = self.lookups.call(
            lambda: self._lookup(request.request_id, r.keys, tokens, num_computed_tokens, pinned),
            (num_computed_tokens, {}))
        r.lookup = (num_computed_tokens, end)
        return end - num_computed_tokens, end > num_computed_tokens

    def _lookup(self, request_id: str, keys: PrefixKeys, tokens: list[int], start: int,
                pinned: dict[str, str]) -> tuple[int, dict[str, str]]:
        """(the furthest resume point stored, pinned copies of its entries if pins are on); ``pinned``: the
        copies of this request's last lookup, kept if it needs the same entries (a request vLLM could not
        schedule is looked up again in the next step)."""
        for _ in range(MAX_PIN_RETRIES):
            end = resume_point(start, len(tokens), self.chunk, lambda h: self.store.check(keys.history_key(tokens, h)),
                               lambda boundary: self._window_ends(keys, tokens, boundary))
            if self.pins is None or end == start:
                return end, {}
            needed = [keys.history_key(tokens, h) for h in history_ends(start, end, self.chunk)]
            needed.append(keys.window_key(tokens, end))
            if set(pinned) == set(needed) and all(Path(p).is_file() for p in pinned.values()):
                return end, pinned
            pins = self.pins.pin(request_id, needed)
            if isinstance(pins, dict):
                return end, pins
            self.store.discard(pins)  # damaged: the next try resumes before it
        return start, {}

    def _window_ends(self, keys: PrefixKeys, tokens: list[int], boundary: int):
        """Ends of the stored window entries of ``tokens`` listed under ``boundary``."""
        for name in self.store.list(keys.window_dir(tokens, boundary)):
            end = PrefixKeys.window_end(boundary, name)  # the key's hash must be of these tokens
            if end is not None and end <= len(tokens) and keys.window_key(tokens, end) == name \
                    and self.store.check(name):
                yield end

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
            key = r.keys.history_key(tokens, h)
            loads.append(Load(h, key, [
                [(i, group_ids[p]) for i, p in enumerate(history_positions(group, h, self.chunk))]
                for group, group_ids in zip(self.groups, ids)], r.pins.get(key)))
        copies = []
        for group, group_ids in zip(self.groups, ids):
            first = window_positions(group, end, self.chunk).start
            copies.append([(p - first, group_ids[p]) for p in loaded_window_positions(group, start, end, self.chunk)
                           if group_ids[p] != NULL_BLOCK])
        key = r.keys.window_key(tokens, end)
        loads.append(Load(end, key, copies, r.pins.get(key)))
        self._pending_loads[request.request_id] = loads

    def build_connector_meta(self, scheduler_output) -> DSV4ConnectorMetadata:
        meta = DSV4ConnectorMetadata(saves=self._finish_saves, loads=self._pending_loads)
        self._awaiting_load |= set(self._pending_loads)
        self._pending_loads, self._finish_saves = {}, []
        if not self.saves:
            return meta
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            r = self._requests.get(new.req_id)
            if r is not None:
                r.block_ids = [list(ids) for ids in new.block_ids]
                self._plan_saves(meta, r, new.num_computed_tokens, scheduled[new.req_id], arrived=True)
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
        if self.pins is not None and request.request_id not in self._awaiting_load:
            self.pins.release(request.request_id)  # else once the workers report the load
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

    def update_connector_output(self, connector_output) -> None:
        """Drops the pinned copies of the requests the workers have loaded."""
        for req_id in connector_output.finished_recving or ():
            self._awaiting_load.discard(req_id)
            if self.pins is not None:
                self.pins.release(req_id)

    def _track(self, request) -> _Request:
        r = self._requests.get(request.request_id)
        if r is None:
            salt = self.fingerprint + (getattr(request, "cache_salt", None) or "").encode()
            r = self._requests[request.request_id] = _Request(request.prompt_token_ids, PrefixKeys(salt, self.chunk))
        return r

    def _plan_saves(self, meta: DSV4ConnectorMetadata, r: _Request, computed: int, scheduled: int,
                    arrived: bool = False) -> None:
        """``arrived``: the request's first step, whose ``computed`` tokens it did not compute here."""
        history, windows = save_ends(computed, computed + scheduled, len(r.prompt), self.chunk, self.window_every)
        if arrived:  # entries already stored are left out (_saves)
            history = arrived_history_ends(computed, len(r.prompt), self.chunk) + history
        meta.saves += self._saves(r.keys, r.prompt, history, windows, r.block_ids)

    def _saves(self, keys: PrefixKeys, tokens, history: list[int], windows: list[int],
               block_ids: list[list[int]]) -> list[Save]:
        """The entries not yet stored among the history and window entries at these ends (all of them
        if the store does not say in time)."""
        wanted = [(e, key_of(tokens, e), positions) for ends, key_of, positions in (
            (history, keys.history_key, history_positions), (windows, keys.window_key, window_positions)) for e in ends]
        if not wanted:
            return []
        stored = self.lookups.call(lambda: [self.store.contains(key) for _, key, _ in wanted], [False] * len(wanted))
        return [Save(e, key, [[ids[p] for p in positions(group, e, self.chunk)]
                              for group, ids in zip(self.groups, block_ids)])
                for (e, key, positions), present in zip(wanted, stored) if not present]

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
        path = Path(load.pin) if load.pin else self.store.path(load.key)
        try:
            header, payload = read_entry(path, self.store.secret) if load.pin else self.store.read(load.key)
            self._check_layout(path, load, header, payload.nbytes)
        except EntryError:
            if not load.pin:
                self.store.discard(load.key)  # computed and saved again by the request that now recomputes it
            raise
        self._copy_in(load, header, payload)

    def _check_layout(self, path: Path, load: Load, header: dict, payload_bytes: int) -> None:
        """EntryError unless ``header`` describes pages of this model's cache for ``load``'s resume point,
        as many bytes as the payload holds, and every page ``load`` copies."""
        if header.get("format") != FORMAT or header.get("fingerprint") != self.fingerprint.hex():
            raise EntryError(f"KV entry {path} was written for another model, cache layout or secret")
        groups = header.get("groups")
        if header.get("end") != load.end or not isinstance(groups, list) or len(groups) != len(self.groups):
            raise EntryError(f"KV entry {path} holds another resume point")
        total = 0
        for group, stored, copies in zip(self.groups, groups, load.copies):
            pages = [self._pages[name].shape[1] for name in group.layers]
            blocks = stored.get("blocks") if isinstance(stored, dict) else None
            if stored != {"blocks": blocks, "layers": list(group.layers), "page_bytes": pages} \
                    or type(blocks) is not int or any(not 0 <= s < blocks for s, _ in copies):
                raise EntryError(f"KV entry {path}: its pages do not fit this cache")
            total += blocks * sum(pages)
        if total != payload_bytes:
            raise EntryError(f"KV entry {path}: {payload_bytes} payload bytes for {total} bytes of pages")

    def _copy_in(self, load: Load, header: dict, payload: memoryview) -> None:
        """Copies the pages ``load`` names from a checked entry into the cache."""
        data = torch.frombuffer(payload, dtype=torch.uint8) if payload.nbytes else torch.empty(0, dtype=torch.uint8)
        data = data.to(next(iter(self._pages.values())).device)  # one host-to-device copy per entry
        offset = 0
        for group, stored, copies in zip(self.groups, header["groups"], load.copies):
            src = torch.tensor([s for s, _ in copies], dtype=torch.long, device=data.device)
            dst = torch.tensor([d for _, d in copies], dtype=torch.long, device=data.device)
            for name, page_bytes in zip(group.layers, stored["page_bytes"]):
                size = stored["blocks"] * page_bytes
                if copies:
                    self._pages[name][dst] = data[offset:offset + size].view(stored["blocks"], page_bytes)[src]
                offset += size

