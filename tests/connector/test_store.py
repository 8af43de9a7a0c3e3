"""The connector's entry store: whole entries or none, damaged files refused with the reason, LRU budget."""

import os
import time

import numpy as np
import pytest

from vllm_dsv4.connector.store import EntryError, EntryStore


def payload(seed: int, size: int = 4096) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def test_round_trip(tmp_path):
    store = EntryStore(tmp_path)
    parts = [payload(0), payload(1, 10), np.zeros(0, np.uint8)]
    store.write("k", {"end": 7}, parts)
    assert store.check("k") and not store.check("missing")
    header, data = store.read("k")
    assert header["end"] == 7
    assert bytes(data) == b"".join(p.tobytes() for p in parts)
    assert [p.name for p in tmp_path.glob("*.kv*")] == ["k.kv"]  # nothing left from writing


def test_a_truncated_entry_is_dropped_at_lookup_and_refused_at_read(tmp_path):
    store = EntryStore(tmp_path)
    store.write("k", {}, [payload(0)])
    path = store.path("k")
    whole = path.read_bytes()
    path.write_bytes(whole[:-1])
    with pytest.raises(EntryError, match="truncated"):
        store.read("k")
    assert not store.check("k") and not path.exists()


def test_an_altered_entry_fails_its_digest(tmp_path):
    store = EntryStore(tmp_path)
    store.write("k", {}, [payload(0)])
    path = store.path("k")
    data = bytearray(path.read_bytes())
    data[-5] ^= 1
    path.write_bytes(data)
    assert store.check("k")  # the size is right: only reading the payload can tell
    with pytest.raises(EntryError, match="digest mismatch"):
        store.read("k")


def test_a_foreign_file_is_refused(tmp_path):
    store = EntryStore(tmp_path)
    store.path("k").write_bytes(b"not an entry at all")
    with pytest.raises(EntryError, match="magic"):
        store.read("k")
    assert not store.check("k")


def test_the_budget_evicts_least_recently_used_entries(tmp_path):
    store = EntryStore(tmp_path, max_bytes=5 * 4500)
    for i in range(4):
        store.write(f"k{i}", {}, [payload(i)])
        os.utime(store.path(f"k{i}"), (time.time() - 100 + i, time.time() - 100 + i))
    store.read("k0")  # used: now the most recent
    for i in range(4, 6):
        store.write(f"k{i}", {}, [payload(i)])
    kept = sorted(p.stem for p in tmp_path.glob("*.kv"))
    assert sum(p.stat().st_size for p in tmp_path.glob("*.kv")) <= 0.9 * store.max_bytes
    assert "k0" in kept and "k5" in kept and "k1" not in kept


def test_keys_in_folders_are_listed_by_folder(tmp_path):
    store = EntryStore(tmp_path)
    for key in ("a/1-x", "a/2-y", "b"):
        store.write(key, {}, [payload(0, 10)])
    assert sorted(store.list("a")) == ["a/1-x", "a/2-y"] and store.list("missing") == []
    assert store.check("a/2-y") and store.read("a/1-x")[0]["payload_bytes"] == 10

