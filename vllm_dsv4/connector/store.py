"""The connector's entry store: one file per entry in a directory (tmpfs such as /dev/shm for CPU
memory, a local disk, or a filesystem that prefill and decode hosts share).

A key is a relative path (``name`` or ``dir/name``); its file is ``<key>.kv``:
``MAGIC | digest (32 B) | header length (u32) | JSON header (an object) | payload``. The digest covers
every byte after it: SHA-256, or HMAC-SHA256 with the store's secret, so that without the secret
nobody can plant an entry the store accepts. Anything that is not a whole, valid entry is refused
with the reason, never loaded: ``check`` (a lookup: magic, header, size) and ``read`` (also the
digest) raise or answer nothing but :class:`EntryError` / False for any content of the file.

The store is a trust boundary. Its directory must belong to this user and be writable by nobody else
(created 0700, files 0600); with ``group`` it may belong to any member of that group and be written
by the group (created 02770, files 0640), never by others. Writers publish by rename from a uniquely
named temporary file, so readers see whole files or none and engines can share the directory. A
store that cannot be written (a read-only mount, another user's files) is still read.

Budget: ``max_bytes`` holds across every process that uses the store, through a ledger file updated
under a lock file: a writer reserves its entry's bytes before writing, evicting least recently used
entries (reads refresh an entry's mtime) down to 90% of the budget when it would go over. Eviction
rescans the directory (and so does a writer whose ledger is older than ``RESCAN_S``): entries others
removed are forgotten, temporary files of killed writers older than ``STALE_TEMP_S`` are removed, and
so are the directories eviction empties.
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import json
import os
import stat
import struct
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterable, Iterator

from vllm_dsv4 import get_logger

MAGIC = b"DSV4KV\x00\x02"
SUFFIX = ".kv"
TEMP_SUFFIX = ".tmp"
DIGEST_BYTES = 32
PREFIX_BYTES = len(MAGIC) + DIGEST_BYTES + 4
MAX_HEADER_BYTES = 1 << 20
LOCK_FILE, LEDGER_FILE = ".lock", ".ledger"
RESCAN_S = 60.0  # the longest a ledger goes unchecked against the directory
STALE_TEMP_S = 600.0  # a temporary file this old belongs to a writer that died
EVICT_TO = 0.9  # eviction leaves the store at this fraction of its budget
DEFAULT_BUDGET_FRACTION = 0.5  # of the filesystem's free space, without max_bytes

logger = get_logger(__name__)


class EntryError(RuntimeError):
    """An entry that cannot be used: missing, truncated, corrupted or made for another configuration."""


class UnsafeStoreError(PermissionError):
    """A store directory others could write to (or that another user owns)."""


@dataclass(frozen=True)
class Access:
    """Who shares the store: this user alone (``group`` None) or the members of group id ``group``."""

    group: int | None = None

    @property
    def dir_mode(self) -> int:
        return 0o700 if self.group is None else 0o2770  # setgid: new entries get the group

    @property
    def file_mode(self) -> int:
        return 0o600 if self.group is None else 0o640

    def refusal(self, st: os.stat_result) -> str | None:
        """Why a directory with status ``st`` must not hold this store; None if it may."""
        if st.st_mode & stat.S_IWOTH:
            return "it is writable by every user"
        if self.group is None:
            if st.st_uid != os.geteuid():
                return f"it belongs to user id {st.st_uid}, not this user ({os.geteuid()})"
            if st.st_mode & stat.S_IWGRP:
                return "it is writable by its group (set 'group' to share a store with a group)"
        elif st.st_gid != self.group:
            return f"its group is {st.st_gid}, not the configured {self.group}"
        return None


class EntryStore:
    def __init__(self, root: str | os.PathLike, max_bytes: int | None = None, secret: bytes | None = None,
                 access: Access = Access()):
        """Opens (creating it if needed) the store at ``root``; :class:`UnsafeStoreError` if others could
        write to it. ``max_bytes`` None: ``DEFAULT_BUDGET_FRACTION`` of its filesystem's free space."""
        self.root, self.secret, self.access = Path(root), secret, access
        self._make_dir(self.root, parents=True)
        if (reason := access.refusal(os.stat(self.root))) is not None:
            raise UnsafeStoreError(f"refusing {self.root} as a KV entry store: {reason}")
        if max_bytes is None:
            free = os.statvfs(self.root)
            max_bytes = int(DEFAULT_BUDGET_FRACTION * free.f_bavail * free.f_frsize)
        self.max_bytes = max_bytes

    def path(self, key: str) -> Path:
        return self.root / f"{key}{SUFFIX}"

    def contains(self, key: str) -> bool:
        return self.path(key).is_file()

    def check(self, key: str) -> bool:
        """Whether ``key`` is present as a whole entry (magic, header, size; not yet the digest); a file
        that is not is removed (logged) so the prefix is computed and saved again."""
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                _read_head(f, path)
        except FileNotFoundError:
            return False
        except (OSError, EntryError) as e:
            logger.warning("vllm-dsv4: dropping unusable KV entry: %s", e)
            _remove(path)
            return False
        return True

    def list(self, directory: str) -> list[str]:
        """The keys in ``directory`` (names without the suffix; none if it does not exist)."""
        try:
            names = os.listdir(self.root / directory)
        except OSError:
            return []
        return [f"{directory}/{n[: -len(SUFFIX)]}" for n in names if n.endswith(SUFFIX) and not n.startswith(".")]

    def write(self, key: str, header: dict, parts: Iterable[memoryview]) -> int:
        """Publishes ``parts`` (bytes-like, concatenated) under ``key``; returns the file's size."""
        parts = [memoryview(p).cast("B") for p in parts if memoryview(p).nbytes]
        head = json.dumps(dict(header, payload_bytes=sum(p.nbytes for p in parts)), sort_keys=True).encode()
        length = struct.pack("<I", len(head))
        digest = self._digest([length, head, *parts])
        size = PREFIX_BYTES + len(head) + sum(p.nbytes for p in parts)
        path = self.path(key)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}{TEMP_SUFFIX}")
        try:
            with self._reserve(tmp, size) as f:
                for piece in (MAGIC, digest, length, head, *parts):
                    f.write(piece)
            os.replace(tmp, path)
        except OSError:  # the ledger counts the bytes until its next scan: never too few
            _remove(tmp)
            raise
        return size

    def read(self, key: str) -> tuple[dict, memoryview]:
        """The header and payload of ``key``; :class:`EntryError` naming the file and the problem."""
        path = self.path(key)
        header, payload = read_entry(path, self.secret)
        try:
            os.utime(path)  # recently used: evicted last (a read-only store or a removed file: no matter)
        except OSError:
            pass
        return header, payload

    def discard(self, key: str) -> None:
        _remove(self.path(key))

    # -- budget -------------------------------------------------------------------------------------

    def _reserve(self, tmp: Path, size: int) -> BinaryIO:
        """``tmp`` created ``size`` bytes long and counted in the shared ledger, evicting entries if the
        budget needs it; scans see the bytes a writer has reserved, as the length of its file."""
        with self._locked():
            total, scanned = self._ledger()
            if total + size > self.max_bytes or time.time() - scanned > RESCAN_S:
                total, scanned = self._scan_and_evict(size), time.time()
            f = self._create(tmp, size)
            self._write_ledger(total + size, scanned)
        return f

    @contextmanager
    def _locked(self) -> Iterator[None]:
        fd = os.open(self.root / LOCK_FILE, os.O_RDWR | os.O_CREAT, self.access.file_mode)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def _ledger(self) -> tuple[int, float]:
        """(bytes, time of the last scan) from the ledger; (0, 0) if it is missing or damaged (a rescan)."""
        try:
            ledger = json.loads((self.root / LEDGER_FILE).read_bytes())
            return int(ledger["bytes"]), float(ledger["scanned"])
        except (OSError, ValueError, KeyError, TypeError):
            return 0, 0.0

    def _write_ledger(self, total: int, scanned: float) -> None:
        with self._create(self.root / LEDGER_FILE) as f:
            f.write(json.dumps({"bytes": total, "scanned": scanned}).encode())

    def _scan_and_evict(self, incoming: int) -> int:
        """The bytes the store holds after making room for ``incoming`` more: removes stale temporary
        files, then least recently used entries while over budget, then the directories left empty."""
        entries, total, now = [], 0, time.time()
        for path, st in self._files():
            if path.name.endswith(TEMP_SUFFIX) and now - st.st_mtime > STALE_TEMP_S:
                _remove(path)
                continue
            total += st.st_size
            if path.name.endswith(SUFFIX):
                entries.append((st.st_mtime, st.st_size, path))
        if total + incoming <= self.max_bytes:
            return total
        emptied = set()
        for _, size, path in sorted(entries, key=lambda e: e[0]):
            if total + incoming <= EVICT_TO * self.max_bytes:
                break
            if _remove(path):
                total -= size
                emptied.add(path.parent)
        for directory in emptied - {self.root}:
            try:
                directory.rmdir()
            except OSError:  # not empty (a writer got there first), or not ours
                pass
        return total

    def _files(self) -> Iterator[tuple[Path, os.stat_result]]:
        """Every entry and temporary file (the root's and its directories'), with its status."""
        directories = [self.root] + [path for path, st in _scan(self.root) if stat.S_ISDIR(st.st_mode)]
        for directory in directories:
            for path, st in _scan(directory):
                if stat.S_ISREG(st.st_mode) and path.name.endswith((SUFFIX, TEMP_SUFFIX)):
                    yield path, st

    # -- files --------------------------------------------------------------------------------------

    def _create(self, path: Path, size: int = 0) -> BinaryIO:
        """``path`` opened for writing with the store's file mode (its directory made if missing),
        ``size`` bytes long from the start."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        try:
            fd = os.open(path, flags, self.access.file_mode)
        except FileNotFoundError:  # its window directory is new, or eviction just removed it
            self._make_dir(path.parent)
            fd = os.open(path, flags, self.access.file_mode)
        f = open(fd, "wb")
        f.truncate(size)
        return f

    def _make_dir(self, path: Path, parents: bool = False) -> None:
        """Creates ``path`` with the store's mode and group (the umask left out); an existing one stays."""
        try:
            path.mkdir(parents=parents, mode=self.access.dir_mode)
        except FileExistsError:
            return
        if self.access.group is not None:
            os.chown(path, -1, self.access.group)
        os.chmod(path, self.access.dir_mode)

    def _digest(self, pieces: Iterable[bytes | memoryview]) -> bytes:
        return _digest(self.secret, pieces)


def read_entry(path: Path, secret: bytes | None) -> tuple[dict, memoryview]:
    """The header and payload of the entry file at ``path`` once its digest is verified;
    :class:`EntryError` naming the file and the problem otherwise."""
    header, whole = _verified(path, secret)
    return header, memoryview(whole)[len(whole) - header["payload_bytes"] :]  # writable: tensors view it


def copy_entry(path: Path, destination: Path, secret: bytes | None) -> None:
    """Writes the entry at ``path`` to a new file ``destination`` (0600), the bytes it verified."""
    _, whole = _verified(path, secret)
    with open(os.open(destination, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
        f.write(whole)


def _verified(path: Path, secret: bytes | None) -> tuple[dict, bytearray]:
    """The header and the whole file of a valid entry, read once."""
    try:
        with open(path, "rb") as f:
            whole = bytearray(os.fstat(f.fileno()).st_size)
            got = f.readinto(whole)
    except OSError as e:
        raise EntryError(f"KV entry {path}: cannot be read ({e.strerror or e})") from e
    if got != len(whole):
        raise EntryError(f"KV entry {path}: changed while it was read (truncated)")
    digest, head_len = _prefix(whole[:PREFIX_BYTES], len(whole), path)
    header = _header(bytes(whole[PREFIX_BYTES : PREFIX_BYTES + head_len]), len(whole) - PREFIX_BYTES - head_len,
                     path)
    if not hmac.compare_digest(digest, _digest(secret, [memoryview(whole)[PREFIX_BYTES - 4 :]])):
        raise EntryError(f"KV entry {path}: digest mismatch (corrupted, or written with another secret)")
    return header, whole


def header_of(path: Path) -> dict:
    """The header of the entry file at ``path``, checked against the file's size (not the digest)."""
    with open(path, "rb") as f:
        return _read_head(f, path)


def _read_head(f, path: Path) -> dict:
    """The header of the entry file open as ``f``, checked against the file's size (not the digest)."""
    size = os.fstat(f.fileno()).st_size
    _, head_len = _prefix(f.read(PREFIX_BYTES), size, path)
    return _header(f.read(head_len), size - PREFIX_BYTES - head_len, path)


def _prefix(prefix: bytes, size: int, path: Path) -> tuple[bytes, int]:
    """(digest, header length) from a file's first ``PREFIX_BYTES``; :class:`EntryError` if they are
    not an entry's of a file of ``size`` bytes."""
    if len(prefix) < PREFIX_BYTES or prefix[: len(MAGIC)] != MAGIC:
        raise EntryError(f"KV entry {path}: not a vllm-dsv4 KV entry of this version (bad magic)")
    (head_len,) = struct.unpack_from("<I", prefix, len(MAGIC) + DIGEST_BYTES)
    if head_len > min(MAX_HEADER_BYTES, size - PREFIX_BYTES):
        raise EntryError(f"KV entry {path}: header length {head_len} is impossible (corrupted or truncated)")
    return bytes(prefix[len(MAGIC) : len(MAGIC) + DIGEST_BYTES]), head_len


def _header(head: bytes, payload_bytes: int, path: Path) -> dict:
    """The parsed header, which must be a JSON object giving the payload's size as ``payload_bytes``."""
    try:
        header = json.loads(head)
    except (ValueError, RecursionError) as e:
        raise EntryError(f"KV entry {path}: unreadable header ({type(e).__name__})") from e
    if not isinstance(header, dict) or type(header.get("payload_bytes")) is not int:
        raise EntryError(f"KV entry {path}: the header is not an entry's (no payload size)")
    if payload_bytes != header["payload_bytes"]:
        raise EntryError(f"KV entry {path}: payload is {payload_bytes} bytes, the header says "
                         f"{header['payload_bytes']} (truncated or partly written)")
    return header


def _digest(secret: bytes | None, pieces: Iterable[bytes | memoryview]) -> bytes:
    h = hmac.new(secret, digestmod="sha256") if secret else hashlib.sha256()
    for piece in pieces:
        h.update(piece)
    return h.digest()


def _scan(directory: Path) -> list[tuple[Path, os.stat_result]]:
    """(path, lstat) of the entries of ``directory``; none if it cannot be listed."""
    found = []
    try:
        with os.scandir(directory) as it:
            for e in it:
                try:
                    found.append((Path(e.path), e.stat(follow_symlinks=False)))
                except OSError:  # removed meanwhile
                    pass
    except OSError:
        pass
    return found


def _remove(path: Path) -> bool:
    """Removes ``path`` if this process may; whether it did."""
    try:
        path.unlink()
        return True
    except OSError:  # gone already, a read-only store, another user's file
        return False
