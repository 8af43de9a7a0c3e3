"""MTP speculative decoding (model/mtp.py) under vLLM on CPU, fp32, against transformers.

transformers has no MTP layer: the reference assembles §7 from its modules
(tests/oracle/hf_oracle.HFMTPReference). The draft's log-probs at every position it scored must
match that reference (first draft steps, and second ones fed the first's output), and speculation
must not change greedy outputs: with two draft tokens per step (and prefix-cache hits), with one (and
chunked prefill; and under TP = 2) they equal transformers' greedy continuations. The prompts cross the tiny model's C4 and C128 boundaries and its 16-token window, so
rejected drafts have written caches and compressor states that the next step must overwrite.
"""


import pytest
import torch

from tests.e2e.test_generate import ENGINE, LOGIT_TOL, make_prompts, run_vllm, worker_env
from tests.e2e.test_kv_connector import connector
from tests.oracle.hf_oracle import HFMTPReference, greedy_sequence

pytestmark = pytest.mark.e2e

PROMPTS = make_prompts((7, 129, 600), seed=3)
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def reference(tiny_ckpt_unquantized):
    return HFMTPReference(tiny_ckpt_unquantized)


@pytest.fixture(scope="module")
def greedy(reference):
    """transformers' greedy continuation of each prompt."""
    return [greedy_sequence(reference.main, p, NEW_TOKENS)[len(p):] for p in PROMPTS]


# (draft tokens per step, engine settings): two draft tokens per step with a second batch of the same
# prompts served from the prefix cache (vLLM drops the last cached block of the draft's KV group, which
# it recomputes); one with prompts prefilled in 64-token chunks (the draft runs on every chunk) after
# the warm-up steps a GPU engine takes before it is ready (warmup.py, the draft in them); one
# under tensor parallelism (the draft's heads and experts split like the main model's); one whose
# prompts, all but their last token, a prefill engine left in a DSV4Connector store (the draft's cache
# included)
RUNS = {"k2-prefix-cache": (2, dict(enable_prefix_caching=True)),
        "k1-chunked": (1, dict(max_num_batched_tokens=64, enable_chunked_prefill=True, warm_up=True)),
        "k1-tp2": (1, dict(tensor_parallel_size=2)),
        "k1-from-store": (1, dict(from_store=True))}
if torch.cuda.is_available():  # verify steps (3 tokens per request) replayed from full CUDA graphs
    RUNS["k2-cuda-graphs"] = (2, dict(enforce_eager=False, compilation_config={
        "cudagraph_mode": "FULL_DECODE_ONLY", "max_cudagraph_capture_size": 24}))


def records_draft_rows(settings: dict) -> bool:
    """Draft rows are recorded where the draft runs in the test's process on whole prompts."""
    return settings.get("tensor_parallel_size", 1) == 1 and not settings.get("enable_chunked_prefill")


RECORDED_RUNS = [name for name, (_, settings) in RUNS.items() if records_draft_rows(settings)]


@pytest.fixture(scope="module", params=list(RUNS))
def drafted(request, tmp_path_factory, tiny_ckpt_unquantized):
    """A vLLM run with ``k`` MTP draft tokens per step; where the draft runs in this process (one
    worker) on whole prompts, every row it scores is recorded. (At the end of a partial prefill chunk
    vLLM 0.32's drafter embeds the prompt's last token, not the next one, and its proposal is dropped;
    the draft's cache entry at that position keeps it, so later rows in its window differ from §7.)"""
    k, settings = RUNS[request.param]
    settings, work = dict(settings), tmp_path_factory.mktemp(request.param)
    warm_up = settings.pop("warm_up", False)
    spec = {"method": "mtp", "num_speculative_tokens": k}
    if settings.pop("from_store", False):
        producer = dict(ENGINE, speculative_config=spec, kv_transfer_config=connector(work / "store", "kv_producer"))
        run_vllm(work, tiny_ckpt_unquantized, producer, [{"prompts": PROMPTS}], "prefill", max_tokens=1)
        settings["kv_transfer_config"] = connector(work / "store", "kv_consumer")
    env = worker_env(settings.get("tensor_parallel_size", 1))
    record = records_draft_rows(settings)
    engine = dict(ENGINE, speculative_config=spec, **settings)
    batches = [{"prompts": PROMPTS}] * (2 if settings.get("enable_prefix_caching") else 1)
    run = run_vllm(work, tiny_ckpt_unquantized, engine, batches, request.param, env, max_tokens=NEW_TOKENS,
                   record_draft_logprobs=record, warm_up_kernels=warm_up)
    if warm_up:
        assert all(calls["prefill"] and calls["decode"] for calls in run["warm_up_calls"]), run["warm_up_calls"]
    return k, dict(run, engine=engine, recorded=record)


def test_drafting_keeps_greedy_outputs(drafted, greedy):
    k, run = drafted
    for batch in run["batches"]:
        assert [r["tokens"] for r in batch] == greedy
    if len(run["batches"]) > 1:  # the 600-token prompt's first 256-token block came from the cache (the
        # second is the last full one, which vLLM recomputes for the draft)
        assert run["batches"][1][2]["num_cached_tokens"] > 0, [r["num_cached_tokens"] for r in run["batches"][1]]
    if "kv_transfer_config" in run["engine"]:
        assert [r["num_cached_tokens"] for r in run["batches"][0]] == [len(p) - 1 for p in PROMPTS]
    if "compilation_config" in run["engine"]:  # vLLM keeps full graphs only for backends that replay verify steps
        assert "is not supported with spec-decode" not in run["log"], run["log"][-3000:]
    counters = run["spec_decode"]
    drafts = counters["vllm:spec_decode_num_drafts"]
    assert drafts >= len(run["batches"]) * NEW_TOKENS // (k + 1), counters  # drafted in every step
    assert counters["vllm:spec_decode_num_draft_tokens"] == k * drafts, counters


@pytest.mark.parametrize("drafted", RECORDED_RUNS, indirect=True)
def test_draft_logprobs_match_the_reference(drafted, reference, greedy):
    """Every row the draft scored: first draft steps (the main model's streams at p, the token at p + 1)
    against ``reference.logprobs`` of the request's sequence, second ones (k = 2: the first step's
    output streams, its draft token) against ``reference.chained_logprobs``."""
    k, run = drafted
    assert run["recorded"]
    sequences = [p + g for p, g in zip(PROMPTS, greedy)]
    expected = [reference.logprobs(seq) for seq in sequences]  # [len - 1, V] each
    rows = run["draft_rows"]
    first = [row for row in rows if not row[3]]
    chained = [row for row in rows if row[3]]
    # one row per request and step and draft token, from the prefill's last position on (a few left
    # out as ambiguous)
    assert len(first) >= len(run["batches"]) * len(PROMPTS) * NEW_TOKENS // (2 * k), len(first)
    assert len(chained) >= (k - 1) * len(first) // 2, (len(chained), len(first))
    errors = []
    for position, token, logprobs, _ in first:
        candidates = [ref[position] for seq, ref in zip(sequences, expected)
                      if position + 1 < len(seq) and seq[position + 1] == token]
        assert candidates, f"draft row at position {position} embeds {token}, in no request's sequence"
        errors.append(min((logprobs - ref).abs().max().item() for ref in candidates))
    for position, draft, logprobs, _ in chained:  # which request: the one whose reference matches
        errors.append(min((logprobs - reference.chained_logprobs(seq, position, draft)).abs().max().item()
                          for seq in sequences if position < len(seq)))
    assert max(errors) < LOGIT_TOL, (max(errors), sorted(errors)[-5:])


def test_drafting_without_an_mtp_module_is_named(tiny_ckpt, tmp_path):
    """A checkpoint without the MTP module (num_nextn_predict_layers 0, no mtp.* tensors) serves, but
    asked to draft with it, the engine's configuration fails naming the problem (vLLM alone divides by
    zero)."""
    import json
    import shutil

    from vllm.engine.arg_utils import EngineArgs

    from vllm_dsv4 import plugin

    ckpt = tmp_path / "no_mtp"
    shutil.copytree(tiny_ckpt, ckpt, ignore=shutil.ignore_patterns("model-mtp*"))
    config = json.loads((ckpt / "config.json").read_text())
    config["num_nextn_predict_layers"] = 0
    config["compress_ratios"] = config["compress_ratios"][: config["num_hidden_layers"]]
    (ckpt / "config.json").write_text(json.dumps(config))
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    index["weight_map"] = {name: f for name, f in index["weight_map"].items() if not name.startswith("mtp.")}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))

    plugin.register()
    args = EngineArgs(model=str(ckpt), skip_tokenizer_init=True, max_model_len=512,
                      speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    with pytest.raises(ValueError, match=r"this checkpoint has none \(num_nextn_predict_layers = 0\)"):
        args.create_engine_config()
