"""The connector's entry store: one file per entry in a directory (tmpfs such as /dev/shm for CPU
memory, a local disk, or a filesystem that prefill and decode hosts share).

A key is a relative path (``name`` or ``dir/name``); its file is ``<key>.kv``:
``MAGIC | header length (u64) | JSON header | payload``; the header names every part of the
payload and carries its length and CRC-32, so a truncated or altered file is refused with the reason,
never loaded. Writers publish by rename, so readers see whole files or none, and several engines can
share one directory. With ``max_bytes`` the least recently used files are removed past the budget.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from pathlib import Path
from typing import Iterable

from vllm_dsv4 import get_logger

MAGIC = b"DSV4KV\x00\x01"
SUFFIX = ".kv"

logger = get_logger(__name__)


class EntryError(RuntimeError):
    """An entry that cannot be used: missing, truncated, corrupted or made for another configuration."""


class EntryStore:
    def __init__(self, root: str | os.PathLike, max_bytes: int | None = None):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self._bytes = sum(f.stat().st_size for f in self._files()) if max_bytes else 0

    def path(self, key: str) -> Path:
        return self.root / f"{key}{SUFFIX}"

    def contains(self, key: str) -> bool:
        return self.path(key).is_file()

    def check(self, key: str) -> bool:
        """Whether ``key`` is present as a whole entry (its header parses and its size is the header's);
        a file that is not is removed (logged), so the prefix is computed and saved again."""
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                _read_head(f, path)
        except FileNotFoundError:
            return False
        except (OSError, EntryError) as e:
            logger.warning("vllm-dsv4: dropping unusable %s", e)
            path.unlink(missing_ok=True)
            return False
        return True

    def list(self, directory: str) -> list[str]:
        """The keys in ``directory`` (names without the suffix; none if it does not exist)."""
        try:
            names = os.listdir(self.root / directory)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return [f"{directory}/{n[: -len(SUFFIX)]}" for n in names if n.endswith(SUFFIX)]

    def write(self, key: str, header: dict, parts: Iterable[memoryview]) -> int:
        """Publishes ``parts`` (bytes-like, concatenated) under ``key``; returns the file's size."""
        parts = [memoryview(p).cast("B") for p in parts if memoryview(p).nbytes]
        header = dict(header, payload_bytes=sum(p.nbytes for p in parts), crc32=_crc32(parts))
        head = json.dumps(header, sort_keys=True).encode()
        path = self.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(MAGIC + struct.pack("<Q", len(head)) + head)
                for p in parts:
                    f.write(p)
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        size = len(MAGIC) + 8 + len(head) + header["payload_bytes"]
        if self.max_bytes:
            self._bytes += size
            if self._bytes > self.max_bytes:
                self._evict()
        return size

    def read(self, key: str) -> tuple[dict, memoryview]:
        """The header and payload of ``key``; :class:`EntryError` naming the file and the problem."""
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                header, payload_bytes = _read_head(f, path)
                payload = bytearray(payload_bytes)  # writable: tensors view it without a copy
                f.readinto(payload)
        except OSError as e:
            raise EntryError(f"KV entry {path}: cannot be read ({e.strerror or e})") from e
        if _crc32([memoryview(payload)]) != header.get("crc32"):
            raise EntryError(f"KV entry {path}: payload checksum mismatch (corrupted)")
        os.utime(path)  # recently used: evicted last
        return header, memoryview(payload)

    def discard(self, key: str) -> None:
        self.path(key).unlink(missing_ok=True)

    def _files(self) -> list[Path]:
        return [p for p in self.root.rglob(f"*{SUFFIX}") if p.is_file()]

    def _evict(self) -> None:
        """Removes least recently used entries until the store is within 90% of its budget."""
        files = []
        for p in self._files():
            try:
                st = p.stat()
            except FileNotFoundError:  # another engine removed it
                continue
            files.append((st.st_mtime, st.st_size, p))
        self._bytes = sum(size for _, size, _ in files)
        for _, size, p in sorted(files, key=lambda f: f[0]):
            if self._bytes <= 0.9 * self.max_bytes:
                break
            p.unlink(missing_ok=True)
            self._bytes -= size


def _read_head(f, path: Path) -> tuple[dict, int]:
    """The header of the entry file open as ``f`` (left at its payload) and the payload's size, which
    must be the header's; :class:`EntryError` otherwise."""
    head = f.read(len(MAGIC) + 8)
    if len(head) < len(MAGIC) + 8 or head[: len(MAGIC)] != MAGIC:
        raise EntryError(f"KV entry {path}: not a vllm-dsv4 KV entry (bad magic)")
    (head_len,) = struct.unpack_from("<Q", head, len(MAGIC))
    try:
        header = json.loads(f.read(head_len))
    except ValueError as e:
        raise EntryError(f"KV entry {path}: unreadable header ({e})") from e
    payload_bytes = os.fstat(f.fileno()).st_size - len(MAGIC) - 8 - head_len
    if payload_bytes != header.get("payload_bytes"):
        raise EntryError(f"KV entry {path}: payload is {payload_bytes} bytes, the header says "
                         f"{header.get('payload_bytes')} (truncated or partly written)")
    return header, payload_bytes


def _crc32(parts: Iterable[memoryview]) -> int:
    crc = 0
    for p in parts:
        crc = zlib.crc32(p, crc)
    return crc
