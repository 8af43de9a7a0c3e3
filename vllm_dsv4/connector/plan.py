"""What the KV connector stores and loads, as block positions of vLLM's KV-cache groups (no I/O, no vLLM).

A request can resume at token ``P`` (its first token still to compute) from its caches' state after
``P`` tokens. The store keeps *entries*, each the state needed at one resume point ``end``:
- a *chunk entry* at every multiple of the chunk ``C`` (the lcm of the groups' block sizes, vLLM's
  scheduler block) and a *tail entry* at a prompt's last token (``P = L - 1``: what a decode instance
  of prefill/decode disaggregation resumes at);
- for a full-history group, the blocks of the tokens since the previous chunk boundary: the entries
  of every chunk before ``end`` together hold all the history;
- for a window group, the blocks from the first token a resumed request reads again
  (``Component.resume_start``: the attention window, the compressor's open pooling windows) to ``end``.

Entries are keyed by a hash chain over the token ids (:class:`PrefixKeys`), so equal prefixes meet
across requests, engines and restarts, and a key names one prefix of one model configuration.
"""

from __future__ import annotations

import hashlib
from array import array
import math
from dataclasses import dataclass, field
from typing import Sequence

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


def entry_ends(start: int, end: int, chunk: int) -> list[int]:
    """The entries a request that has ``start`` tokens (a multiple of ``chunk``) reads to resume at ``end``."""
    ends = list(range(start + chunk, end + 1, chunk))
    return ends + [end] if end % chunk else ends


def stored_positions(group: Group, end: int, chunk: int) -> range:
    """Block positions (token // block size) of ``group`` that the entry at ``end`` holds."""
    b = group.block_tokens
    first = (end - 1) // chunk * chunk if group.history else group.first_read(end)
    return range(first // b, -(-end // b))


def loaded_positions(group: Group, entry_end: int, start: int, end: int, chunk: int) -> range:
    """The positions a request with ``start`` tokens takes from the entry at ``entry_end`` to resume at
    ``end``: every stored history block, window blocks from the last entry only; none below ``start``
    (they are the request's own, maybe shared, prefix-cache blocks)."""
    if not group.history and entry_end != end:
        return range(0)
    stored = stored_positions(group, entry_end, chunk)
    return range(max(stored.start, start // group.block_tokens), stored.stop)


def save_ends(computed: int, computed_after: int, num_prompt_tokens: int, chunk: int) -> list[int]:
    """The entries a request's step that takes it from ``computed`` to ``computed_after`` tokens
    completes: chunk boundaries within the prompt, and the prompt's tail once the whole prompt is in."""
    last = min(computed_after, num_prompt_tokens)
    ends = list(range((computed // chunk + 1) * chunk, last + 1, chunk))
    tail = num_prompt_tokens - 1
    if computed < num_prompt_tokens <= computed_after and tail > 0 and tail % chunk:
        ends.append(tail)
    return ends


def resume_candidates(num_tokens: int, chunk: int) -> tuple[list[int], int | None]:
    """Chunk boundaries a request of ``num_tokens`` tokens can resume at (it computes at least its last
    token), and its tail position when that is not one of them."""
    last = num_tokens - 1
    return list(range(chunk, last + 1, chunk)), (last if last > 0 and last % chunk else None)


@dataclass
class PrefixKeys:
    """Store keys of one token sequence's resume points: ``chain[k]`` hashes the first ``k`` chunks
    (extended on demand), a tail key hashes its last chunk boundary's key with the tokens after it."""

    salt: bytes
    chunk: int
    chain: list[bytes] = field(default_factory=list)

    def key(self, tokens: Sequence[int], end: int) -> str:
        whole = end // self.chunk
        if not self.chain:
            self.chain.append(hashlib.blake2b(self.salt, digest_size=16).digest())
        while len(self.chain) <= whole:
            k = len(self.chain) - 1
            self.chain.append(_hash(self.chain[k], tokens[k * self.chunk:(k + 1) * self.chunk]))
        if end % self.chunk == 0:
            return self.chain[whole].hex()
        return _hash(self.chain[whole] + b"tail", tokens[whole * self.chunk:end]).hex()


def _hash(prefix: bytes, tokens: Sequence[int]) -> bytes:
    h = hashlib.blake2b(prefix, digest_size=16)
    h.update(array("q", tokens).tobytes())
    return h.digest()
