"""DSV4Connector end to end: prefill/decode disaggregation and prefix reuse through the entry store,
and what happens when an entry is damaged. Each engine is its own process (run_vllm.py); the decode
engines' outputs are checked against transformers on the whole prompt, so a cache component that was
not moved, or moved to the wrong block, shows up as different tokens or log-probs."""

import functools
import shutil
from pathlib import Path

import pytest

from tests.e2e.test_generate import ENGINE, LOGIT_TOL, MAX_TOKENS, make_prompts, run_vllm, worker_env
from tests.oracle.hf_oracle import forced_logprobs, load_hf_reference
from vllm_dsv4.connector.store import header_of

pytestmark = pytest.mark.e2e

CHUNK = 256  # the scheduler block: history entries at its multiples
LONG, SHORT = make_prompts([600, 300], seed=11)
PARTIAL = LONG[:300] + make_prompts([50], seed=12)[0]  # shares one chunk with LONG
NEXT_TURN = SHORT + make_prompts([40], seed=13)[0]  # a conversation's next prompt extends the last


def connector(store: Path, role: str, window_every: int | None = None, **options) -> dict:
    extra = {"path": str(store)} | ({"window_every": window_every} if window_every else {})
    return {"kv_connector": "DSV4Connector", "kv_role": role, "kv_connector_extra_config": extra, **options}


@pytest.fixture(scope="module")
def store(tmp_path_factory, tiny_ckpt_unquantized) -> Path:
    """A prefill engine's entries for LONG and SHORT (128-token prefill chunks: saves span steps; window
    entries at every chunk boundary, not only at the prompts' last tokens)."""
    work = tmp_path_factory.mktemp("kv_prefill")
    engine = dict(ENGINE, max_num_batched_tokens=128,
                  kv_transfer_config=connector(work / "store", "kv_producer", window_every=CHUNK))
    run_vllm(work, tiny_ckpt_unquantized, engine, [{"prompts": [LONG, SHORT]}], "prefill", max_tokens=1)
    return work / "store"


@pytest.fixture(scope="module")
def decoded(tmp_path_factory, tiny_ckpt_unquantized, store):
    """A decode engine (prefix caching on) given PARTIAL and SHORT, then LONG, which then extends its
    local hit on PARTIAL's first block with entries from the store, then NEXT_TURN, which resumes where
    SHORT's prompt ended."""
    engine = dict(ENGINE, max_num_batched_tokens=4096, enable_prefix_caching=True,
                  kv_transfer_config=connector(store, "kv_consumer"))
    batches = [{"prompts": [PARTIAL, SHORT], "logprobs": True, "prompt_logprobs": False},
               {"prompts": [LONG], "logprobs": True, "prompt_logprobs": False},  # (they would skip every hit)
               {"prompts": [NEXT_TURN], "logprobs": True, "prompt_logprobs": False}]
    return run_vllm(tmp_path_factory.mktemp("kv_decode"), tiny_ckpt_unquantized, engine, batches, "decode")


@pytest.fixture(scope="module")
def reference(tiny_ckpt_unquantized):
    return functools.partial(forced_logprobs, load_hf_reference(tiny_ckpt_unquantized))


def assert_matches_transformers(reference, prompt: list[int], ours: dict, max_tokens: int = MAX_TOKENS) -> None:
    ref = reference(prompt, ours["tokens"])
    assert ours["tokens"] == ref.argmax(-1).tolist()  # greedy, position by position
    assert len(ours["tokens"]) == max_tokens
    if "logprobs" in ours:
        assert (ours["logprobs"] - ref).abs().max() <= LOGIT_TOL


def history_entries(store: Path) -> list[Path]:
    return list(store.glob("*.kv"))  # window entries live in a folder named by their prefix


def window_entries(store: Path) -> list[Path]:
    return list(store.glob("*/*.kv"))


def test_prefill_engine_stores_history_and_window_entries(store):
    assert len(history_entries(store)) == 3  # LONG: 256, 512; SHORT: 256
    assert len(window_entries(store)) == 5  # LONG: 256, 512, 599; SHORT: 256, 299


def test_decode_engine_resumes_from_the_store(decoded):
    cached = [[r["num_cached_tokens"] for r in batch] for batch in decoded["batches"]]
    # PARTIAL: LONG's first chunk; SHORT: all but its last token; LONG: 256 local + 343 from the store;
    # NEXT_TURN: 256 local + SHORT's window entry
    assert cached == [[CHUNK, len(SHORT) - 1], [len(LONG) - 1], [len(SHORT) - 1]]


def test_decode_engine_outputs_match_transformers(decoded, reference):
    for prompt, ours in zip([PARTIAL, SHORT, LONG, NEXT_TURN], sum(decoded["batches"], [])):
        assert_matches_transformers(reference, prompt, ours)


def entry_end(path: Path) -> int:
    """The resume point in an entry file's header."""
    return header_of(path)["end"]


def entry_at(entries: list[Path], end: int) -> Path:
    """The one file of ``entries`` for resume point ``end``."""
    found = [path for path in entries if entry_end(path) == end]
    assert len(found) == 1, (end, found)
    return found[0]


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_damaged_entries_are_refused_and_the_engine_keeps_serving(tmp_path, tiny_ckpt_unquantized, store, reference,
                                                                 policy):
    damaged = tmp_path / "store"
    shutil.copytree(store, damaged)
    altered, cut = entry_at(history_entries(damaged), 2 * CHUNK), entry_at(window_entries(damaged), len(SHORT) - 1)
    data = bytearray(altered.read_bytes())
    data[-1000] ^= 0xFF
    altered.write_bytes(data)
    cut.write_bytes(cut.read_bytes()[:-100])
    engine = dict(ENGINE, max_num_batched_tokens=4096, enable_prefix_caching=False,
                  kv_transfer_config=connector(damaged, "kv_consumer", kv_load_failure_policy=policy))
    result = run_vllm(tmp_path, tiny_ckpt_unquantized, engine, [{"prompts": [LONG, SHORT]}, {"prompts": [LONG]}],
                      "damaged")
    (long_first, short), (long_again,) = result["batches"]
    assert "digest mismatch" in result["log"] and "truncated" in result["log"]
    assert short["num_cached_tokens"] == CHUNK  # its tail was refused at lookup: the window entry before it
    assert_matches_transformers(reference, SHORT, short)
    if policy == "fail":
        assert long_first["finish_reason"] == "error"
    else:
        assert_matches_transformers(reference, LONG, long_first)
    # the altered history entry was dropped: LONG now resumes at the window entry before it
    assert long_again["num_cached_tokens"] == CHUNK
    assert_matches_transformers(reference, LONG, long_again)


def test_tensor_parallel_engine_saves_once_and_every_rank_loads(tmp_path, tiny_ckpt_unquantized, reference):
    """TP = 2, kv_both, no local prefix cache: the first request saves (rank 0: its prompt, and when it
    finishes where it stopped), the second loads on both ranks (a rank left with its own uncomputed pages
    would change the all-reduced outputs), the third, its prompt followed by the first's output (the
    next turn of a conversation), resumes where the first stopped."""
    env = worker_env(2)
    engine = dict(ENGINE, max_num_batched_tokens=4096, tensor_parallel_size=2, enable_prefix_caching=False,
                  kv_transfer_config=connector(tmp_path / "store", "kv_both"))
    batches = [{"prompts": [SHORT]}, {"prompts": [SHORT]}, {"prompts": [SHORT], "extend_with_batch": 0}]
    result = run_vllm(tmp_path, tiny_ckpt_unquantized, engine, batches, "tp2", env)
    (first,), (second,), (next_turn,) = result["batches"]
    stopped = len(SHORT) + MAX_TOKENS - 1  # the first request's last token was sampled, never computed
    assert len(history_entries(tmp_path / "store")) == 1  # 256
    assert sorted(entry_end(p) for p in window_entries(tmp_path / "store")) == [len(SHORT) - 1, stopped]
    cached = [r["num_cached_tokens"] for r in (first, second, next_turn)]
    assert cached == [0, len(SHORT) - 1, stopped]
    for ours in (first, second):
        assert_matches_transformers(reference, SHORT, ours)
    assert_matches_transformers(reference, SHORT + first["tokens"], next_turn, max_tokens=1)
