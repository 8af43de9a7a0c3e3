"""The accept path of speculative decoding, which random draft weights never reach: the drafter's proposals
are forced (forced_drafts.py) to transformers' greedy continuation of each request. Every draft right: each
verify step commits all N drafts and the target's next token, N + 1 tokens; the draft at k wrong: exactly
k + 1 (drafts 0 .. k-1 accepted every time, k and after never). DSpark at N = 5 (tiny-0731), MTP at k = 1
and 2 (tiny), MTP also under TP = 2 (held to the same exact counts as TP = 1, so it accepts exactly what TP = 1
accepts). The outputs stay the greedy ones.
"""

import pytest

from tests.e2e.test_generate import ENGINE, make_prompts, run_vllm, worker_env
from tests.oracle.hf_oracle import greedy_sequence, load_hf_reference

pytestmark = pytest.mark.e2e

PROMPTS = make_prompts((7, 40, 129), seed=7)
STEPS = 24  # tokens after the prefill's: a multiple of every N + 1 and k + 1 below, so no step is cut short

# run -> (checkpoint fixture, method, N, engine settings, the draft positions made wrong, one batch each)
RUNS = {
    "dspark-n5": ("tiny_0731_ckpt_unquantized", "dspark", 5, {}, (None, 2, 0)),
    "mtp-k1": ("tiny_ckpt_unquantized", "mtp", 1, {}, (None, 0)),
    "mtp-k2": ("tiny_ckpt_unquantized", "mtp", 2, {}, (None, 1, 0)),
    "mtp-k2-tp2": ("tiny_ckpt_unquantized", "mtp", 2, dict(tensor_parallel_size=2), (None, 1, 0)),
}


def greedy_sequences(checkpoint, extra: int) -> list[list[int]]:
    """Each prompt followed by transformers' greedy continuation, ``extra`` tokens past the run's."""
    model = load_hf_reference(checkpoint)
    return [greedy_sequence(model, p, 1 + STEPS + extra) for p in PROMPTS]


@pytest.fixture(scope="module", params=list(RUNS))
def forced(request, tmp_path_factory):
    fixture, method, n, settings, wrong = RUNS[request.param]
    checkpoint = request.getfixturevalue(fixture)
    sequences = greedy_sequences(checkpoint, n + 1)
    engine = dict(ENGINE, speculative_config={"method": method, "num_speculative_tokens": n}, **settings)
    batches = [{"prompts": PROMPTS, "wrong_at": k} for k in wrong]
    run = run_vllm(tmp_path_factory.mktemp(request.param), checkpoint, engine, batches, request.param,
                   worker_env(settings.get("tensor_parallel_size", 1)), max_tokens=1 + STEPS, force_drafts=sequences)
    return request.param, n, wrong, sequences, run


def per_batch(run) -> list[dict]:
    """vLLM's speculative-decoding counters of each batch alone."""
    totals, out, before = run["spec_decode_batches"], [], {}
    for after in totals:
        out.append({name: ([a - b for a, b in zip(value, before.get(name, [0] * len(value)))]
                           if isinstance(value, list) else value - before.get(name, 0))
                    for name, value in after.items()})
        before = after
    return out


def test_forced_drafts_commit_what_they_should(forced):
    name, n, wrong, sequences, run = forced
    for batch in run["batches"]:  # the outputs are the greedy ones whatever was drafted
        assert [r["tokens"] for r in batch] == [s[len(p): len(p) + 1 + STEPS] for p, s in zip(PROMPTS, sequences)]
    for k, counters in zip(wrong, per_batch(run)):
        committed = n + 1 if k is None else k + 1  # tokens per verify step
        drafts = counters["vllm:spec_decode_num_drafts"]
        assert drafts == len(PROMPTS) * STEPS // committed, (k, counters)
        assert counters["vllm:spec_decode_num_draft_tokens"] == n * drafts, (k, counters)
        assert counters["vllm:spec_decode_num_accepted_tokens"] == (committed - 1) * drafts, (k, counters)
        per_position = counters["vllm:spec_decode_num_accepted_tokens_per_pos"]
        assert per_position == [drafts if i < committed - 1 else 0 for i in range(n)], (k, counters)

