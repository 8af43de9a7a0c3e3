"""The scheduler side's reach into the store: bounded in time, and pinned where a load must not fail late.

``BoundedCalls`` runs the scheduler's store I/O (listing, header checks, pins) on one helper thread
and waits a bounded time: a store on a mount that hangs costs lookup misses, never the engine loop;
while a call still hangs, later ones miss at once instead of queueing behind it.

``Pins`` keeps private, verified copies of the entries a request will load, made when it is looked
up. vLLM 0.26 cannot recompute a load that fails in the worker (compat ledger 5), so there a load
must not be able to fail: the worker reads the copy, which no other engine evicts, no writer replaces
and nobody else can write. Copies live in a 0700 directory of this process (on /dev/shm where there
is one), removed once the worker has loaded them, when the request ends without loading, and at exit.
"""

from __future__ import annotations

import atexit
import itertools
import shutil
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Callable, TypeVar

from vllm_dsv4 import get_logger
from vllm_dsv4.connector.store import EntryStore, copy_entry

T = TypeVar("T")
logger = get_logger(__name__)


class BoundedCalls:
    """Calls that return their fallback instead of waiting longer than ``timeout_s``."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="dsv4-kv-lookup")
        self._hung: Future | None = None

    def call(self, fn: Callable[[], T], fallback: T) -> T:
        if self._hung is not None and not self._hung.done():
            return fallback
        future = self._pool.submit(fn)
        try:
            return future.result(self.timeout_s)
        except FutureTimeout:
            self._hung = future
            logger.warning("DSV4Connector: the entry store did not answer within %gs; lookups miss until it "
                           "does", self.timeout_s)
            return fallback


class Pins:
    """Verified private copies of entries, grouped by request (see the module docstring)."""

    def __init__(self, store: EntryStore):
        self.store = store
        base = "/dev/shm" if Path("/dev/shm").is_dir() else None
        self.root = Path(tempfile.mkdtemp(prefix="dsv4-kv-pins-", dir=base))
        atexit.register(shutil.rmtree, self.root, True)
        self._lock = threading.Lock()  # pins are made on the lookup thread, released on the engine's
        self._dirs: dict[str, Path] = {}
        self._numbers = itertools.count()

    def pin(self, request_id: str, keys: list[str]) -> dict[str, str] | str:
        """Copies of ``keys`` for ``request_id`` (key -> file), replacing its earlier ones; or the first
        key whose entry is not valid (its copies are then dropped)."""
        self.release(request_id)
        with self._lock:
            directory = self._dirs[request_id] = self.root / str(next(self._numbers))
        directory.mkdir()
        copies = {}
        for key in keys:
            copies[key] = str(directory / f"{len(copies)}.kv")
            try:
                copy_entry(self.store.path(key), Path(copies[key]), self.store.secret)
            except Exception as e:  # noqa: BLE001 - whatever the store holds, this lookup just misses
                logger.warning("DSV4Connector: not loading %s (%s)", self.store.path(key), e)
                self.release(request_id)
                return key
        return copies

    def release(self, request_id: str) -> None:
        with self._lock:
            directory = self._dirs.pop(request_id, None)
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)
