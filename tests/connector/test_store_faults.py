"""The entry store under faults and attacks: every single-bit flip and every truncation of a real entry,
forged headers, planted entries, a store others can write to, a consumer that cannot write, writers in
several processes sharing one budget, writers that died, and two writers of one key in one process.

A refused entry is a lookup miss (``check`` False) or an :class:`EntryError` when it is read; any other
exception, or an entry that reads back different bytes, fails these tests."""

import errno
import fcntl
import hashlib
import json
import multiprocessing
import os
import stat
import struct
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from vllm_dsv4.connector import store as store_module
from vllm_dsv4.connector.store import Access, EntryError, EntryStore, UnsafeStoreError

HEADER = {"format": 1, "end": 512, "groups": [{"blocks": 2, "layers": ["layers.0.attn.swa_cache"], "page_bytes": [96]}]}


def payload(seed: int, size: int = 192) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def refused(store: EntryStore, key: str, original: bytes) -> bool:
    """Whether the store refuses ``key``; fails (raises) if it serves other bytes than ``original``
    or raises anything but EntryError."""
    if not store.check(key):
        return True
    try:
        header, data = store.read(key)
    except EntryError:
        return True
    assert bytes(data) == original and header == dict(HEADER, payload_bytes=len(original)), "served altered bytes"
    return False


@pytest.fixture
def entry(tmp_path):
    store = EntryStore(tmp_path / "store", max_bytes=1 << 20)
    data = payload(0)
    store.write("k", HEADER, [data])
    return store, store.path("k").read_bytes(), data.tobytes()


def test_every_single_bit_flip_is_refused(entry):
    store, whole, original = entry
    path = store.path("k")
    served = []
    for bit in range(len(whole) * 8):
        damaged = bytearray(whole)
        damaged[bit // 8] ^= 1 << (bit % 8)
        path.write_bytes(damaged)
        if not refused(store, "k", original):
            served.append(bit)
    assert served == []


def test_every_truncation_is_refused(entry):
    store, whole, original = entry
    path = store.path("k")
    for cut in range(len(whole)):
        path.write_bytes(whole[:cut])
        assert refused(store, "k", original), cut
    path.write_bytes(whole + b"x")  # and a byte too many
    assert refused(store, "k", original)


def forge(path: Path, head: bytes, body: bytes = b"") -> None:
    """An entry file with a correct digest (as anyone without the secret can compute one)."""
    length = struct.pack("<I", len(head))
    digest = hashlib.sha256(length + head + body).digest()
    path.write_bytes(store_module.MAGIC + digest + length + head + body)


@pytest.mark.parametrize("head", [
    b"[]", b"null", b'"x"', b"{}", b'{"payload_bytes": "3"}', b'{"payload_bytes": 3.0}', b'{"payload_bytes": true}',
    b'{"payload_bytes": 99}', b"[" * 100_000 + b"]" * 100_000, b'{"payload_bytes": 3, "a": ' + b"[" * 100_000,
    b"\xff\xfe",
])
def test_a_forged_header_is_refused(tmp_path, head):
    store = EntryStore(tmp_path, max_bytes=1 << 20)
    forge(store.path("k"), head, b"abc")
    with pytest.raises(EntryError):
        store.read("k")
    assert not store.check("k") and not store.path("k").exists()


@pytest.mark.parametrize("length", [2**32 - 1, 2**31, 1 << 21, 10_000])
def test_an_impossible_header_length_is_refused(tmp_path, length):
    store = EntryStore(tmp_path, max_bytes=1 << 20)
    store.write("k", {}, [payload(1)])
    data = bytearray(store.path("k").read_bytes())
    struct.pack_into("<I", data, len(store_module.MAGIC) + store_module.DIGEST_BYTES, length)
    store.path("k").write_bytes(data)
    with pytest.raises(EntryError, match="header length"):
        store.read("k")
    assert not store.check("k")


def test_a_keyed_store_refuses_entries_planted_without_its_secret(tmp_path):
    keyed = EntryStore(tmp_path, max_bytes=1 << 20, secret=b"tenant A")
    keyed.write("a", HEADER, [payload(2)])
    assert keyed.read("a")[0]["end"] == 512
    for other in (EntryStore(tmp_path, max_bytes=1 << 20, secret=b"tenant B"), EntryStore(tmp_path, max_bytes=1 << 20)):
        with pytest.raises(EntryError, match="digest mismatch"):
            other.read("a")
    forge(keyed.path("planted"), json.dumps(dict(HEADER, payload_bytes=3)).encode(), b"abc")  # SHA-256, no key
    with pytest.raises(EntryError, match="digest mismatch"):
        keyed.read("planted")


def modes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): stat.S_IMODE(p.stat().st_mode) for p in [root, *root.rglob("*")]}


def test_the_store_is_private_by_default(tmp_path):
    os.umask(0o022)
    store = EntryStore(tmp_path / "new", max_bytes=1 << 20)
    store.write("dir/k", {}, [payload(3)])
    found = modes(tmp_path / "new")
    assert found.pop(".") == 0o700 and found.pop("dir") == 0o700
    assert set(found.values()) == {0o600}, found  # entries, lock and ledger


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o775, 0o722, 0o702])
def test_a_directory_others_can_write_is_refused(tmp_path, mode):
    root = tmp_path / "shared"
    root.mkdir()
    root.chmod(mode)
    with pytest.raises(UnsafeStoreError, match="writable"):
        EntryStore(root, max_bytes=1 << 20)


@pytest.mark.skipif(os.geteuid() != 0, reason="making a directory another user owns needs root")
def test_a_directory_another_user_owns_is_refused(tmp_path):
    root = tmp_path / "theirs"
    root.mkdir(mode=0o700)
    os.chown(root, 65534, 65534)
    with pytest.raises(UnsafeStoreError, match="belongs to user id 65534"):
        EntryStore(root, max_bytes=1 << 20)


def test_a_group_store_is_shared_with_that_group_only(tmp_path):
    os.umask(0o002)
    group = os.getegid()
    store = EntryStore(tmp_path / "team", max_bytes=1 << 20, access=Access(group))
    store.write("dir/k", {}, [payload(4)])
    found = modes(tmp_path / "team")
    assert found.pop(".") == found.pop("dir") == 0o2770 and set(found.values()) == {0o640}, found
    with pytest.raises(UnsafeStoreError, match="writable by its group"):
        EntryStore(tmp_path / "team", max_bytes=1 << 20)  # without 'group' it is someone else's to write
    with pytest.raises(UnsafeStoreError, match="its group is"):
        EntryStore(tmp_path / "team", max_bytes=1 << 20, access=Access(group + 1))


def test_a_consumer_that_cannot_write_still_serves_and_misses_cleanly(tmp_path, monkeypatch):
    """A read-only mount: every write, touch and removal fails with EROFS."""
    store = EntryStore(tmp_path, max_bytes=1 << 20)
    store.write("good", HEADER, [payload(5)])
    store.write("bad", HEADER, [payload(6)])
    bad = bytearray(store.path("bad").read_bytes())
    bad[-1] ^= 1
    store.path("bad").write_bytes(bad)
    store.write("cut", HEADER, [payload(7)])
    store.path("cut").write_bytes(store.path("cut").read_bytes()[:-5])

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(os, "utime", read_only)
    monkeypatch.setattr(Path, "unlink", read_only)
    assert bytes(store.read("good")[1]) == payload(5).tobytes()
    assert not store.check("cut") and store.path("cut").exists()
    with pytest.raises(EntryError, match="digest"):
        store.read("bad")
    store.discard("bad")
    monkeypatch.setattr(os, "open", read_only)
    with pytest.raises(OSError):
        store.write("new", HEADER, [payload(8)])  # the connector logs it and goes on


def test_an_entry_removed_between_read_and_touch_is_served(tmp_path, monkeypatch):
    store = EntryStore(tmp_path, max_bytes=1 << 20)
    store.write("k", HEADER, [payload(9)])

    def gone(path, *args):
        os.unlink(path)
        raise FileNotFoundError(errno.ENOENT, "No such file", str(path))

    monkeypatch.setattr(os, "utime", gone)
    assert bytes(store.read("k")[1]) == payload(9).tobytes()
    assert not store.check("k")


def test_two_writers_of_one_key_in_one_process_never_mix_their_bytes(tmp_path):
    """Threads share a PID, as processes of different containers can: temporary names must not."""
    store = EntryStore(tmp_path, max_bytes=1 << 30)
    datas = [payload(10, 1 << 20), payload(11, 1 << 20)]
    errors = []

    def writer(data):
        try:
            for _ in range(20):
                store.write("k", HEADER, [data])
        except Exception as e:  # noqa: BLE001 - the test reports whatever a writer raised
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(d,)) for d in datas]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert bytes(store.read("k")[1]) in {d.tobytes() for d in datas}
    assert not list(tmp_path.glob(".*.tmp"))


ENTRY = 40_000  # bytes of each entry's payload in the budget tests


def write_many(root: str, budget: int, writer: int, count: int) -> None:
    store = EntryStore(root, max_bytes=budget)
    for i in range(count):
        store.write(f"{writer:02d}/{i:03d}", {}, [payload(writer * 1000 + i, ENTRY)])


def stored_bytes(root: Path) -> int:
    """Bytes of the entry and temporary files under ``root``, counted under the store's lock (unlocked, a
    walk may count an entry eviction then removes and the one written after it)."""
    total = 0
    with open(root / store_module.LOCK_FILE, "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for directory, _, names in os.walk(root):
            for name in names:
                try:
                    total += os.stat(os.path.join(directory, name)).st_size if name.endswith((".kv", ".tmp")) else 0
                except FileNotFoundError:  # renamed by a writer meanwhile
                    pass
    return total


def test_the_budget_holds_across_processes(tmp_path):
    """Eight writers in eight processes, each writing the budget's worth four times over."""
    budget, root = 20 * ENTRY, tmp_path / "store"
    EntryStore(root, max_bytes=budget)
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=write_many, args=(str(root), budget, w, 80)) for w in range(8)]
    for p in procs:
        p.start()
    peak = 0
    while any(p.is_alive() for p in procs):
        peak = max(peak, stored_bytes(root))
        time.sleep(0.01)
    assert all(p.exitcode == 0 for p in procs)
    assert peak <= budget and stored_bytes(root) <= budget, (peak, budget)
    assert sorted(p.name for p in root.iterdir() if p.is_dir()) == sorted(  # emptied directories removed
        {p.parent.name for p in root.rglob("*.kv")})


def test_a_dead_writers_temporary_files_are_removed_and_counted(tmp_path):
    root = tmp_path / "store"
    store = EntryStore(root, max_bytes=10 * ENTRY)
    stale, fresh = root / ".a.kv.dead.tmp", root / ".b.kv.alive.tmp"
    for path in (stale, fresh):
        path.write_bytes(bytes(3 * ENTRY))
    old = time.time() - 2 * store_module.STALE_TEMP_S
    os.utime(stale, (old, old))
    for i in range(8):
        store.write(f"k{i}", {}, [payload(i, ENTRY)])
    assert not stale.exists() and fresh.exists()  # a live writer's file stays, and takes its room
    assert stored_bytes(root) <= store.max_bytes


def test_the_default_budget_is_a_fraction_of_the_free_space(tmp_path):
    free = os.statvfs(tmp_path)
    expected = store_module.DEFAULT_BUDGET_FRACTION * free.f_bavail * free.f_frsize
    assert EntryStore(tmp_path).max_bytes == pytest.approx(expected, rel=0.01)
