"""What the KV connector stores and loads, as block positions of vLLM's KV-cache groups (no I/O, no vLLM).

A request resumes at token ``E`` (its first token still to compute) from its caches' state after ``E``
tokens. With ``C`` the chunk (the lcm of the groups' block sizes, vLLM's scheduler block) the store
keeps two kinds of entries:
- a *history entry* at every multiple ``h`` of ``C`` within a prompt: the full-history groups' blocks of
  tokens ``[h - C, h)`` (compressed KV, indexer keys). Together they hold the whole history, once.
- a *window entry* at a resume point ``E``: what else resuming at ``E`` reads, the window groups' blocks
  from the first token it reads again (``Component.resume_start``: the attention window, the
  compressor's open pooling windows) and the history since the last multiple of ``C``. Saved at every
  multiple of the ``window_every`` interval (prefix reuse at that granularity) and at every prompt's
  last token ``L - 1`` (where a decode engine of prefill/decode disaggregation resumes), and where a
  request that generated text stopped (where the next turn of a conversation, a prompt extending the
  whole sequence, resumes: :func:`finish_ends`).

Windows are most of an entry's bytes (V4-Flash, FP8: 4.1 MB per resume point against 1 MB of history
per 256 tokens), hence their sparser interval. A resume at ``E`` from ``S`` tokens of local prefix
cache reads the history entries in ``(S, E]`` and the window entry at ``E``. Keys chain hashes of the
token ids (:class:`PrefixKeys`), so equal prefixes meet across requests, engines and restarts.
"""

from __future__ import annotations

import hashlib
import math
from array import array
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from vllm_dsv4.kv.layout import Component


@dataclass(frozen=True)
class Group:
    """One vLLM KV-cache group: its block size in tokens, its layers and the component of each."""

    block_tokens: int
    layers: tuple[str, ...]
    components: tuple[Component, ...]

    @property
    def history(self) -> bool:
        return all(c.window_tokens is None for c in self.components)

    def first_read(self, position: int) -> int:
        """First token a request resumed at ``position`` reads from this group's caches."""
        return min(c.resume_start(position) for c in self.components)


def chunk_tokens(groups: Sequence[Group]) -> int:
    return math.lcm(*(g.block_tokens for g in groups))


def history_positions(group: Group, end: int, chunk: int) -> range:
    """Block positions (token // block size) of ``group`` in the history entry at ``end``."""
    b = group.block_tokens
    return range((end - chunk) // b, end // b) if group.history else range(0)


def window_positions(group: Group, end: int, chunk: int) -> range:
    """Block positions of ``group`` in the window entry at ``end``."""
    first = end // chunk * chunk if group.history else group.first_read(end)
    return range(first // group.block_tokens, -(-end // group.block_tokens))


def history_ends(start: int, end: int, chunk: int) -> range:
    """The history entries a request with ``start`` tokens (a multiple of ``chunk``) reads to resume at ``end``."""
    return range(start + chunk, end + 1, chunk)


def resume_point(start: int, num_tokens: int, chunk: int, has_history: Callable[[int], bool],
                 window_ends: Callable[[int], Iterable[int]]) -> int:
    """The furthest token a request of ``num_tokens`` tokens with ``start`` in its caches (a multiple of
    ``chunk``) can resume at; it computes at least its last token. ``has_history(h)``: the history entry
    at ``h`` is stored; ``window_ends(b)``: ends of the stored window entries of this request's tokens
    that extend the chunk boundary ``b`` (ends in ``[b, b + chunk)``)."""
    last, reach = num_tokens - 1, start
    while reach + chunk <= last and has_history(reach + chunk):
        reach += chunk
    for boundary in range(reach, start - 1, -chunk):  # the furthest boundary with a window entry wins
        ends = [e for e in window_ends(boundary) if start < e <= last]
        if ends:
            return max(ends)
    return start


def loaded_window_positions(group: Group, start: int, end: int, chunk: int) -> range:
    """The window entry's positions a request with ``start`` tokens takes: none below ``start`` (its own,
    maybe shared, prefix-cache blocks)."""
    stored = window_positions(group, end, chunk)
    return range(max(stored.start, start // group.block_tokens), stored.stop)


def save_ends(computed: int, computed_after: int, num_prompt_tokens: int, chunk: int,
              window_every: int) -> tuple[list[int], list[int]]:
    """The history and the window entries a step taking a request from ``computed`` to ``computed_after``
    tokens completes within its prompt of ``num_prompt_tokens``."""
    last = min(computed_after, num_prompt_tokens)
    history = list(range((computed // chunk + 1) * chunk, last + 1, chunk))
    windows = list(range((computed // window_every + 1) * window_every, last + 1, window_every))
    tail = num_prompt_tokens - 1
    if computed < num_prompt_tokens <= computed_after and tail > 0 and tail % window_every:
        windows.append(tail)
    return history, windows


def arrived_history_ends(computed: int, num_prompt_tokens: int, chunk: int) -> list[int]:
    """The history entries of the prompt tokens a request had in its caches when first scheduled (a local
    prefix-cache hit, or what another connector loaded, e.g. NIXL on a decode engine): saved as well, so
    that the window entries saved after them resume."""
    return list(range(chunk, min(computed, num_prompt_tokens) + 1, chunk))


def finish_ends(num_prompt_tokens: int, computed: int, chunk: int) -> tuple[list[int], list[int]]:
    """The history and the window entries a finished request leaves for a prompt that extends its
    whole sequence (a conversation's next turn): the history past its prompt and a window entry where
    it stopped, if it generated more than the one token a prefill-only request (disaggregation) does."""
    if computed <= num_prompt_tokens:
        return [], []
    return list(range((num_prompt_tokens // chunk + 1) * chunk, computed + 1, chunk)), [computed]


@dataclass
class PrefixKeys:
    """Store keys of one token sequence: ``chain[k]`` hashes the first ``k`` chunks (extended on demand).
    A history entry's key is its chain hash; a window entry's, ``<chain hash of its last boundary>/
    <offset>-<hash of the tokens since>``, so the window entries that extend a prefix are listed by it."""

    salt: bytes
    chunk: int
    chain: list[bytes] = field(default_factory=list)

    def history_key(self, tokens: Sequence[int], end: int) -> str:
        return self._chain(tokens, end // self.chunk).hex()

    def window_dir(self, tokens: Sequence[int], boundary: int) -> str:
        return self._chain(tokens, boundary // self.chunk).hex()

    def window_key(self, tokens: Sequence[int], end: int) -> str:
        whole = end // self.chunk
        base = self._chain(tokens, whole)
        offset = end - whole * self.chunk
        return f"{base.hex()}/{offset}-{_hash(base + b'window', tokens[whole * self.chunk:end]).hex()}"

    @staticmethod
    def window_end(boundary: int, key: str) -> int | None:
        """The resume point of a window entry's ``key`` listed in ``window_dir(tokens, boundary)``: the
        boundary plus the key's ``<offset>``; None for a name that is not a window entry's (a stray file).
        Whether the entry is of these tokens, only comparing the key with ``window_key(tokens, end)`` says."""
        offset = key.rsplit("/", 1)[-1].split("-", 1)[0]
        return boundary + int(offset) if offset.isascii() and offset.isdigit() and len(offset) < 16 else None

    def _chain(self, tokens: Sequence[int], chunks: int) -> bytes:
        if not self.chain:
            self.chain.append(hashlib.blake2b(self.salt, digest_size=16).digest())
        while len(self.chain) <= chunks:
            k = len(self.chain) - 1
            self.chain.append(_hash(self.chain[k], tokens[k * self.chunk:(k + 1) * self.chunk]))
        return self.chain[chunks]


def _hash(prefix: bytes, tokens: Sequence[int]) -> bytes:
    h = hashlib.blake2b(prefix, digest_size=16)
    h.update(array("q", tokens).tobytes())
    return h.digest()
