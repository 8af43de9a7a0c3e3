"""The in-image window (model/image_window.py) against a loop over tokens written from the spec
(docs/VISION.md §8): blocks found in a step's ids, and each query's window slots."""

from __future__ import annotations

import random

import torch

from vllm_dsv4.config import IMAGE, IMAGE_END, IMAGE_NEWLINE, IMAGE_PAD, IMAGE_START, SENTINEL_BASE_ID
from vllm_dsv4.model.image_window import image_blocks, window_entries

S, P, I, N, E = (SENTINEL_BASE_ID + t for t in (IMAGE_START, IMAGE_PAD, IMAGE, IMAGE_NEWLINE, IMAGE_END))


def blocks_by_loop(ids: list[int], req: list[int], positions: list[int]) -> tuple[list[int], list[int]]:
    """For each START, its request's next END with no START between makes a block; -1 outside blocks."""
    first, last = [-1] * len(ids), [-1] * len(ids)
    for s, token in enumerate(ids):
        if token != S:
            continue
        for e in range(s + 1, len(ids)):
            if req[e] != req[s] or ids[e] == S:
                break
            if ids[e] == E:
                for t in range(s, e + 1):
                    first[t], last[t] = positions[s], positions[e]
                break
    return first, last


def window_by_loop(p: int, window: int, first: int, last: int, reach: int) -> list[int]:
    """§8: left = min(p - first, reach - 1), right = min(last - p, reach) inside a block (reach: 384, the
    largest image); [max(p - 127 - max(left - 127, 0), 0), p + right] with 128 -> ``window``; positions
    below 0 are empty."""
    if first < 0:
        lo, hi = p - window + 1, p
    else:
        left, right = min(p - first, reach - 1), min(last - p, reach)
        lo, hi = p - (window - 1) - max(left - (window - 1), 0), p + right
    return [q for q in range(lo, hi + 1) if q >= 0]


def random_step(rng: random.Random) -> tuple[list[int], list[int], list[int]]:
    """A step of up to 3 requests, each at some offset, ids mixing text, whole blocks, stray sentinels."""
    ids, req, positions = [], [], []
    for r in range(rng.randint(1, 3)):
        offset, n = rng.randint(0, 40), 0
        for _ in range(rng.randint(1, 6)):
            kind = rng.random()
            if kind < 0.4:
                piece = [rng.randint(2, 900) for _ in range(rng.randint(1, 12))]
            elif kind < 0.8:
                piece = [P] * rng.randint(0, 3) + [S] + [rng.choice([I, N, P]) for _ in range(rng.randint(1, 20))] + [E]
            else:
                piece = [rng.choice([S, E, I, P])]  # a stray sentinel: opens no block alone
            ids += piece
            req += [r] * len(piece)
            positions += list(range(offset + n, offset + n + len(piece)))
            n += len(piece)
    return ids, req, positions


def test_blocks_and_windows_equal_the_loops():
    rng = random.Random(0)
    for _ in range(300):
        ids, req, positions = random_step(rng)
        first, last = image_blocks(torch.tensor(ids), torch.tensor(req), torch.tensor(positions))
        want_first, want_last = blocks_by_loop(ids, req, positions)
        assert first.tolist() == want_first and last.tolist() == want_last, (ids, req)
        window, reach = rng.choice([4, 16, 128]), rng.choice([6, 384])  # 6: shorter than some blocks
        entries = window_entries(torch.tensor(positions), window, first, last, reach=reach)
        for t, p in enumerate(positions):
            got = [q for q in entries[t].tolist() if q >= 0]
            assert got == window_by_loop(p, window, want_first[t], want_last[t], reach)


def test_padding_rows_and_blocks_across_requests_open_nothing():
    ids = [S, I, E, S, I, I, E]
    req = [0, 0, 0, 1, 1, 1, -1]  # request 1's END is a padding row
    first, _ = image_blocks(torch.tensor(ids), torch.tensor(req), torch.arange(7))
    assert first.tolist() == [0, 0, 0, -1, -1, -1, -1]


def test_without_blocks_the_window_is_the_plain_one():
    positions = torch.tensor([0, 1, 2, 50, 51, 300])
    plain = (positions[:, None] + torch.arange(1 - 16, 1)).clamp(min=-1)
    assert torch.equal(window_entries(positions, 16), plain)
    none = torch.full((6,), -1)
    assert torch.equal(window_entries(positions, 16, none, none, reach=384), plain)


def test_a_block_longer_than_an_image_widens_no_further_than_one():
    """Sentinel ids sent as prompt tokens can pair a START with an END thousands of tokens on; the window
    of a token between them reaches 383 back and 384 ahead at most, as in the reference (§8)."""
    positions = torch.arange(3000)
    ids = torch.full((3000,), 7)
    ids[0], ids[2999] = S, E
    first, last = image_blocks(ids, torch.zeros(3000, dtype=torch.long), positions)
    entries = window_entries(positions, 128, first, last, reach=384)
    assert entries.shape[1] <= 128 + 2 * 384
    row = [q for q in entries[1000].tolist() if q >= 0]
    assert row == list(range(1000 - 383, 1000 + 384 + 1))
    assert [q for q in entries[10].tolist() if q >= 0] == list(range(0, 10 + 384 + 1))
