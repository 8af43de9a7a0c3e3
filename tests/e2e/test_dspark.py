"""DSpark speculative decoding (model/dspark.py, spec_decode/dspark.py) under vLLM on CPU, fp32.

The drafter inside vLLM is compared, at every intermediate of every draft step, with a drafter written from
the spec (tests/oracle/dspark_ref.py, transformers' V4 blocks); and drafting must not change greedy
outputs: at N = 1, 3, 5, 7 draft tokens per step they equal transformers' greedy continuations, with
prefix-cache hits, 61-token prefill chunks (the drafter runs on every chunk), a DSV4Connector resume (the
stages' caches come from the store) and TP = 2. The prompts cross the tiny model's 16-token window and
its C4 and C128 boundaries. (With random weights the drafts are almost never accepted: tests/e2e/
test_forced_drafts.py shows the accept path.)
"""


import pytest
import torch

from tests.e2e.test_generate import ENGINE, LOGIT_TOL, make_prompts, run_vllm, worker_env
from tests.e2e.test_kv_connector import connector
from tests.oracle.dspark_ref import HFDSparkReference
from tests.oracle.hf_oracle import greedy_sequence
from vllm_dsv4 import compat

pytestmark = pytest.mark.e2e

PROMPTS = make_prompts((7, 40, 129, 600), seed=5)
NEW_TOKENS = 24

# (draft tokens per step, engine settings): N = 5 (the block size) recording every intermediate, its block
# steps padded to the batch limit as a CUDA graph's are (padding rows must touch no cache); 1 with
# prompts prefilled in 61-token chunks; 3 with a second batch of the same prompts served from the prefix
# cache, and under tensor parallelism; 7 resuming each prompt but its last token from a prefill engine's
# DSV4Connector store
# vLLM 0.26 itself refuses drafts shorter than the block size (5): there the short runs draft 5
SHORTEST = 5 if compat.is_vllm_026() else 1
RUNS = {"n5-recorded": (5, dict(record_dspark=True, pad_draft_batches=True)),
        "n1-chunked": (1, dict(max_num_batched_tokens=61, enable_chunked_prefill=True)),
        "n3-prefix-cache": (3, dict(enable_prefix_caching=True)),
        "n3-tp2": (3, dict(tensor_parallel_size=2)),
        "n7-from-store": (7, dict(from_store=True))}


@pytest.fixture(scope="module")
def reference(tiny_0731_ckpt_unquantized):
    return HFDSparkReference(tiny_0731_ckpt_unquantized)


@pytest.fixture(scope="module")
def greedy(reference):
    """transformers' greedy continuation of each prompt."""
    return [greedy_sequence(reference.main, p, NEW_TOKENS)[len(p):] for p in PROMPTS]


@pytest.fixture(scope="module", params=list(RUNS))
def drafted(request, tmp_path_factory, tiny_0731_ckpt_unquantized):
    n, settings = RUNS[request.param]
    n, settings, work = max(n, SHORTEST), dict(settings), tmp_path_factory.mktemp(request.param)
    options = {name: settings.pop(name, False) for name in ("record_dspark", "pad_draft_batches")}
    spec = {"method": "dspark", "num_speculative_tokens": n}
    if settings.pop("from_store", False):
        producer = dict(ENGINE, speculative_config=spec, kv_transfer_config=connector(work / "store", "kv_producer"))
        run_vllm(work, tiny_0731_ckpt_unquantized, producer, [{"prompts": PROMPTS}], "prefill", max_tokens=1)
        settings["kv_transfer_config"] = connector(work / "store", "kv_consumer")
    engine = dict(ENGINE, speculative_config=spec, **settings)
    batches = [{"prompts": PROMPTS}] * (2 if settings.get("enable_prefix_caching") else 1)
    run = run_vllm(work, tiny_0731_ckpt_unquantized, engine, batches, request.param, worker_env(settings.get("tensor_parallel_size", 1)),
                   max_tokens=NEW_TOKENS, **options)
    return n, dict(run, engine=engine)


def test_drafting_keeps_greedy_outputs(drafted, greedy):
    n, run = drafted
    for batch in run["batches"]:
        assert [r["tokens"] for r in batch] == greedy
    if len(run["batches"]) > 1:  # the 600-token prompt's first 256-token block came from the cache (the
        # second is the last full one, which vLLM recomputes for drafters)
        assert run["batches"][1][3]["num_cached_tokens"] > 0, [r["num_cached_tokens"] for r in run["batches"][1]]
    if "kv_transfer_config" in run["engine"]:
        assert [r["num_cached_tokens"] for r in run["batches"][0]] == [len(p) - 1 for p in PROMPTS]
    counters = run["spec_decode"]
    drafts = counters["vllm:spec_decode_num_drafts"]
    assert drafts >= len(run["batches"]) * NEW_TOKENS // (n + 1), counters  # drafted in every step
    assert counters["vllm:spec_decode_num_draft_tokens"] == n * drafts, counters


def close(got: torch.Tensor, want: torch.Tensor, what: str, tol: float = LOGIT_TOL) -> float:
    """The largest difference relative to the reference's scale; fails naming ``what``."""
    err = ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp(min=1)).item()
    assert err < tol, f"{what}: {err:.2e}"
    return err


@pytest.mark.parametrize("drafted", ["n5-recorded"], indirect=True)
def test_every_intermediate_matches_the_reference(drafted, reference, greedy):
    """Each draft step of each request: the target features of the step's kept tokens (per target layer),
    main_x, each stage's context KV as its cache holds it (after norm and RoPE) for the window before the
    anchor, each stage's output streams, the head hidden, base and Markov-corrected logits, the confidences
    and the greedy drafts, against the reference given the request's committed tokens and anchor."""
    n, run = drafted
    sequences = {tuple(p): p + g for p, g in zip(PROMPTS, greedy)}
    features = {prompt: reference.features(seq) for prompt, seq in sequences.items()}
    D = reference.config.hidden_size
    steps = 0
    for row in run["draft_rows"]:
        prompt = tuple(row["prompt"])
        seq, P = sequences[prompt], row["P"]
        assert seq[P] == row["anchor"], (P, row["anchor"])  # the anchor is the token just committed
        ref = reference.draft(seq[:P], row["anchor"], n, drafts=row["drafts"], features=features[prompt])
        kept = torch.tensor(row["positions"])
        assert kept.max() == P - 1  # the step's kept tokens end just before the anchor
        for k, f in enumerate(ref["features"]):
            close(row["features"][:, k * D:(k + 1) * D], f[kept], f"features of target layer {reference.targets[k]}")
        close(row["main_x"], ref["main_x"][kept], "main_x")
        for s in range(len(reference.stages)):
            close(row["context_kv"][s], ref["context_kv"][s], f"stage {s} context KV")
            close(row["stages"][s], ref["stages"][s], f"stage {s} output streams")
        close(row["head_hidden"], ref["head_hidden"], "head hidden")
        close(row["base_logits"], ref["base_logits"], "base logits")
        close(row["logits"], ref["logits"], "Markov-corrected logits")
        close(row["confidence"], ref["confidence"], "confidences")
        top2 = ref["logits"].topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 10 * LOGIT_TOL
        assert all(d == int(ref["logits"][k].argmax()) for k, d in enumerate(row["drafts"]) if clear[k])
        steps += 1
    assert steps >= len(PROMPTS) * NEW_TOKENS // 2, steps


@pytest.mark.gpu
def test_cuda_graph_drafts_equal_eager_drafts(tmp_path, tiny_0731_ckpt_unquantized, greedy):
    """The block step replayed from its CUDA graphs (a batch padded to a captured size) drafts what the
    eager step drafts, step by step, and the outputs stay greedy."""
    spec = {"method": "dspark", "num_speculative_tokens": 5}
    graphs = dict(enforce_eager=False, compilation_config={"cudagraph_mode": "FULL_DECODE_ONLY",
                                                           "max_cudagraph_capture_size": 48})
    runs = {name: run_vllm(tmp_path, tiny_0731_ckpt_unquantized, dict(ENGINE, speculative_config=spec, **settings),
                           [{"prompts": PROMPTS}], name, max_tokens=NEW_TOKENS, record_drafts=True)
            for name, settings in (("eager", {}), ("graphs", graphs))}
    assert [r["tokens"] for r in runs["graphs"]["batches"][0]] == greedy
    eager, replayed = (sorted(map(str, runs[name]["draft_rows"])) for name in ("eager", "graphs"))
    assert replayed == eager and len(eager) >= len(PROMPTS) * NEW_TOKENS // 2
