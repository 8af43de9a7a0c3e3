"""The connector's plan (vllm_dsv4/connector/plan.py): which blocks an entry stores, which a resume
loads, which entries a step saves, where a request resumes, and the keys; checked against brute-force
enumerations."""

import random

import pytest
import torch

from tests.conftest import load_make_checkpoint
from vllm_dsv4.config import Dsv4Config, LayerKind
from vllm_dsv4.connector.plan import (
    Group, PrefixKeys, arrived_history_ends, chunk_tokens, finish_ends, history_ends, history_positions,
    loaded_window_positions, resume_point, save_ends, window_positions,
)
from vllm_dsv4.kv.layout import layer_components

CFG = Dsv4Config.from_dict(load_make_checkpoint().make_config("flash", num_layers=3))  # V4-Flash windows
CHUNK = 256


def rows_read_after(name: str, position: int, window: int) -> set[int]:
    """Rows before ``position`` that the tokens from ``position`` on read (§5: the attention window;
    a compressed entry closing at token p pools the state rows of its window, C4 windows overlapping
    the previous window)."""
    reads = set()
    for p in range(position, position + 300):
        if name == "swa":
            reads |= set(range(p - window + 1, p + 1))
        elif (p + 1) % (4 if name != "c128_state" else 128) == 0:
            span = 8 if name != "c128_state" else 128
            reads |= set(range(p - span + 1, p + 1))
    return {r for r in reads if 0 <= r < position}


@pytest.mark.parametrize("name", ["swa", "c4_state", "indexer_state", "c128_state"])
def test_resume_start_is_the_first_row_read_again(name):
    kind = LayerKind.C128 if name.startswith("c128") else LayerKind.C4 if name != "swa" else LayerKind.SWA
    comp = layer_components(CFG, kind, torch.float32, CHUNK)[name]
    for position in range(0, 700):
        expected = min(rows_read_after(name, position, CFG.sliding_window), default=position)
        assert comp.resume_start(position) == expected, position


def groups() -> list[Group]:
    """The tiny model's groups: one per (block size, window) as vLLM forms them."""
    comps = {**layer_components(CFG, LayerKind.C4, torch.float32, CHUNK),
             **layer_components(CFG, LayerKind.C128, torch.float32, CHUNK)}
    members = {}
    for name, c in comps.items():
        members.setdefault((c.block_tokens, c.window_tokens), []).append((f"layers.0.attn.{name}_cache", c))
    return [Group(block, tuple(n for n, _ in m), tuple(c for _, c in m)) for (block, _), m in members.items()]


def test_chunk_is_the_lcm_of_the_block_sizes():
    assert chunk_tokens(groups()) == CHUNK


@pytest.mark.parametrize("seed", range(20))
def test_a_resume_loads_exactly_the_blocks_it_reads(seed):
    """History entries in (start, end] and the window entry at end: each block position the resumed
    request reads (all history from ``start``, window rows from ``first_read``) exactly once."""
    rng = random.Random(seed)
    for _ in range(50):
        start = rng.randrange(0, 4) * CHUNK
        end = rng.randrange(start + 1, start + 3 * CHUNK)
        for g in groups():
            b = g.block_tokens
            loaded = [p for h in history_ends(start, end, CHUNK) for p in history_positions(g, h, CHUNK)]
            window = loaded_window_positions(g, start, end, CHUNK)
            assert set(window) <= set(window_positions(g, end, CHUNK))
            first = start if g.history else max(start, g.first_read(end))
            assert sorted(loaded + list(window)) == list(range(first // b, -(-end // b))), (start, end, b)


WINDOW_EVERY = 4 * CHUNK


@pytest.mark.parametrize("seed", range(10))
def test_a_prompt_computed_in_any_steps_saves_each_entry_once(seed):
    rng = random.Random(seed)
    for _ in range(50):
        prompt = rng.randrange(1, 3000)
        computed = rng.randrange(0, prompt // CHUNK + 1) * CHUNK  # maybe after a hit
        first, history, windows = computed, [], []
        while computed < prompt + 3:  # then a few decode steps
            step = rng.randrange(1, 600)
            h, w = save_ends(computed, computed + step, prompt, CHUNK, WINDOW_EVERY)
            history, windows = history + h, windows + w
            computed += step
        assert history == [e for e in range(CHUNK, prompt + 1, CHUNK) if e > first]
        expected = {e for e in range(WINDOW_EVERY, prompt + 1, WINDOW_EVERY) if e > first}
        expected |= {prompt - 1} if prompt - 1 > first else set()
        assert sorted(windows) == sorted(expected - {0}), (prompt, first)


@pytest.mark.parametrize("seed", range(10))
def test_the_resume_point_is_the_furthest_window_entry_over_whole_history(seed):
    """Against every candidate end checked one by one: an end counts if it is a stored window entry
    and every history entry up to it is stored."""
    rng = random.Random(seed)
    for _ in range(200):
        num_tokens = rng.randrange(2, 2000)
        start = rng.randrange(0, (num_tokens - 1) // CHUNK + 1) * CHUNK
        history = {h for h in range(CHUNK, 2200, CHUNK) if rng.random() < 0.8}
        windows = {e for e in range(1, 2200) if rng.random() < 0.01}
        got = resume_point(start, num_tokens, CHUNK, history.__contains__,
                           lambda b: [e for e in windows if b <= e < b + CHUNK])
        usable = [e for e in windows if start < e <= num_tokens - 1
                  and all(h in history for h in range(start + CHUNK, e + 1, CHUNK))]
        assert got == max(usable, default=start)


def serve(rng: random.Random, prompt: int, generated: int, computed: int, history: set, windows: set) -> int:
    """Steps a request from ``computed`` tokens to its last computed one (the last generated token never
    is): prompt chunks of 1-599 tokens, then one token a step; adds the entry ends it saves to ``history``
    and ``windows``; returns how many tokens it computed."""
    while computed < prompt + generated - 1:
        step = min(rng.randrange(1, 600) if computed < prompt else 1, prompt + generated - 1 - computed)
        h, w = save_ends(computed, computed + step, prompt, CHUNK, WINDOW_EVERY)
        history |= set(h)
        windows |= set(w)
        computed += step
    h, w = finish_ends(prompt, computed, CHUNK)
    history |= set(h)
    windows |= set(w)
    return computed


@pytest.mark.parametrize("seed", range(5))
def test_a_conversations_next_turn_resumes_where_the_last_one_stopped(seed):
    """A request's saves (its prompt's steps, then what it generated) let a prompt extending its whole
    sequence resume at the request's last computed token; one that generated a single token (a
    disaggregated prefill) leaves its prompt's last token."""
    rng = random.Random(seed)
    for _ in range(100):
        prompt, generated = rng.randrange(2, 2000), rng.randrange(1, 700)
        history, windows = set(), set()
        computed = serve(rng, prompt, generated, 0, history, windows)
        next_turn = prompt + generated + rng.randrange(1, 300)
        got = resume_point(0, next_turn, CHUNK, history.__contains__,
                           lambda b: [e for e in windows if b <= e < b + CHUNK])
        assert got == (computed if generated > 1 else prompt - 1), (prompt, generated)


@pytest.mark.parametrize("seed", range(5))
def test_a_turn_whose_prompt_arrived_leaves_what_the_next_turn_resumes_from(seed):
    """A request that had part of its prompt before its first step (all but the last token loaded by
    another connector, NIXL on a decode engine, or a local prefix-cache hit) saves the history of what
    it did not compute as well: the next turn resumes where it stopped."""
    rng = random.Random(seed)
    for _ in range(100):
        prompt, generated = rng.randrange(2, 2000), rng.randrange(2, 700)
        arrived = rng.choice([prompt - 1, rng.randrange(0, prompt)])
        history, windows = set(arrived_history_ends(arrived, prompt, CHUNK)), set()
        computed = serve(rng, prompt, generated, arrived, history, windows)
        got = resume_point(0, prompt + generated + rng.randrange(1, 300), CHUNK, history.__contains__,
                           lambda b: [e for e in windows if b <= e < b + CHUNK])
        assert got == computed, (prompt, generated, arrived)


def test_keys_name_one_prefix():
    rng = random.Random(0)
    tokens = [rng.randrange(1000) for _ in range(900)]
    ends = [256, 512, 300, 599, 1, 768]

    def all_keys(k: PrefixKeys, toks, order=ends):
        out = {}
        for e in order:
            out["w", e] = k.window_key(toks, e)
            if e % CHUNK == 0:
                out["h", e] = k.history_key(toks, e)
        return out

    first = all_keys(PrefixKeys(b"model", CHUNK), tokens)
    assert len(set(first.values())) == len(first)
    assert all_keys(PrefixKeys(b"model", CHUNK), tokens, ends[::-1]) == first  # independent of the order asked
    for e in ends:  # a window entry is listed under its last chunk boundary's chain hash
        assert first["w", e].split("/")[0] == PrefixKeys(b"model", CHUNK).window_dir(tokens, e // CHUNK * CHUNK)
    for changed in (0, 255, 256, 400, 599):
        edited = list(tokens)
        edited[changed] += 1
        again = all_keys(PrefixKeys(b"model", CHUNK), edited)
        assert all((again[kind, e] == first[kind, e]) == (e <= changed) for kind, e in first), changed
    assert PrefixKeys(b"other model", CHUNK).history_key(tokens, 256) != first["h", 256]
