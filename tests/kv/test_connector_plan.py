"""The connector's plan (vllm_dsv4/connector/plan.py): which blocks an entry stores, which a resume
loads, which entries a step saves, and the keys; checked against brute-force enumerations."""

import random

import pytest
import torch

from vllm_dsv4.config import Dsv4Config
from vllm_dsv4.connector.plan import (
    Group,
    PrefixKeys,
    chunk_tokens,
    entry_ends,
    loaded_positions,
    resume_candidates,
    save_ends,
    stored_positions,
)
from tests.conftest import load_make_checkpoint
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
    ratio = 128 if name.startswith("c128") else 4 if name != "swa" else 0
    comp = layer_components(CFG, ratio, torch.float32, CHUNK)[name]
    for position in range(0, 700):
        expected = min(rows_read_after(name, position, CFG.sliding_window), default=position)
        assert comp.resume_start(position) == expected, position


def groups() -> list[Group]:
    """The tiny model's groups: one per (block size, window) as vLLM forms them."""
    comps = {**layer_components(CFG, 4, torch.float32, CHUNK), **layer_components(CFG, 128, torch.float32, CHUNK)}
    members = {}
    for name, c in comps.items():
        members.setdefault((c.block_tokens, c.window_tokens), []).append((f"layers.0.attn.{name}_cache", c))
    return [Group(block, tuple(n for n, _ in m), tuple(c for _, c in m)) for (block, _), m in members.items()]


def test_chunk_is_the_lcm_of_the_block_sizes():
    assert chunk_tokens(groups()) == CHUNK


@pytest.mark.parametrize("seed", range(20))
def test_a_resume_loads_exactly_the_blocks_it_reads_from_entries_that_store_them(seed):
    rng = random.Random(seed)
    for _ in range(50):
        start = rng.randrange(0, 4) * CHUNK
        end = rng.randrange(start + 1, start + 3 * CHUNK)
        for g in groups():
            b = g.block_tokens
            loaded = []
            for e in entry_ends(start, end, CHUNK):
                got = loaded_positions(g, e, start, end, CHUNK)
                assert set(got) <= set(stored_positions(g, e, CHUNK))
                loaded += list(got)
            first = start if g.history else max(start, g.first_read(end))
            assert sorted(loaded) == list(range(first // b, -(-end // b))), (start, end, g.block_tokens)


@pytest.mark.parametrize("seed", range(10))
def test_a_prompt_computed_in_any_steps_saves_every_resume_point_once(seed):
    rng = random.Random(seed)
    for _ in range(50):
        prompt = rng.randrange(1, 1500)
        computed, saved = rng.randrange(0, prompt // CHUNK + 1) * CHUNK, []  # maybe after a hit
        first = computed
        while computed < prompt + 3:  # then a few decode steps
            step = rng.randrange(1, 600)
            saved += save_ends(computed, computed + step, prompt, CHUNK)
            computed += step
        chunks, tail = resume_candidates(prompt, CHUNK)
        expected = [p for p in chunks if p > first] + ([tail] if tail is not None and tail > first else [])
        if prompt % CHUNK == 0 and prompt > first:
            expected.append(prompt)  # a whole last chunk is stored too (a longer prompt can resume there)
        assert sorted(saved) == sorted(expected), (prompt, first)


def test_keys_name_one_prefix():
    rng = random.Random(0)
    tokens = [rng.randrange(1000) for _ in range(900)]
    keys = PrefixKeys(b"model", CHUNK)
    ends = [256, 512, 300, 599, 1, 768]
    first = {e: keys.key(tokens, e) for e in ends}
    assert len(set(first.values())) == len(ends)
    fresh = PrefixKeys(b"model", CHUNK)
    assert {e: fresh.key(tokens, e) for e in reversed(ends)} == first  # independent of the order asked
    other = tokens[:599] + [t + 1 for t in tokens[599:]]  # same first 599 tokens, different after
    assert all(PrefixKeys(b"model", CHUNK).key(other, e) == first[e] for e in ends if e <= 599)
    for changed in (0, 255, 256, 400):
        edited = list(tokens)
        edited[changed] += 1
        k = PrefixKeys(b"model", CHUNK)
        assert all((k.key(edited, e) == first[e]) == (e <= changed) for e in ends)
    assert PrefixKeys(b"other model", CHUNK).key(tokens, 256) != first[256]
