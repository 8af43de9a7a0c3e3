"""Disaggregated prefill over vLLM's NIXL connector (``DSV4NixlConnector``: UCX on 127.0.0.1), as users run
it: a prefill and a decode OpenAI server behind ``scripts/pd_proxy.py``. The decode server is the
composition of one ``--kv-transfer-config``: vLLM's ``MultiConnector`` with NIXL for the hand-off and a
``DSV4Connector`` store as its offload tier.

The decode server's greedy tokens and log-probs are checked against transformers on the whole prompt, so a
cache component that did not arrive (or arrived at another page length) shows as different tokens; its
usage shows it computed only the prompt's last token. A third engine resumes a conversation's next turn
from the decode server's store. Faults: a decode server that never fetches (the prefill server frees the
blocks when vLLM's lease runs out) and a prefill server that dies after answering (the decode server
recomputes, ``kv_load_failure_policy`` ``recompute``, and keeps serving).
"""

import functools
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import pytest
import torch

from tests.conftest import REPO_ROOT, load_module_by_path
from tests.e2e.test_generate import ENGINE, LOGIT_TOL, make_prompts, run_vllm
from tests.oracle.hf_oracle import forced_logprobs, load_hf_reference
from tests.serving.conftest import ENGINE_FLAGS, RUNNING, free_port, running_pd_proxy, stop, vllm_server
from vllm_dsv4 import compat

pytestmark = pytest.mark.e2e

# the tiny checkpoint's window is 16 tokens, blocks are 256 tokens, C4 and C128 entries 4 and 128 tokens
PROMPTS = make_prompts([1, 129, 300, 700, 17, 255, 257, 513], seed=31)
MAX_TOKENS = 16
# The prefill server's kv_lease_duration: how long it keeps blocks nobody reads. The decode server must read
# within it: on 2 shared cores its first reads (after NIXL's handshake) can come after a short lease, and a
# late read stalls (an idle prefill engine on CPU makes no NIXL progress) until the prefill server serves again.
LEASE_S = 120
kv_handoff = load_module_by_path(REPO_ROOT / "scripts" / "kv_handoff.py")
pd_proxy = load_module_by_path(REPO_ROOT / "scripts" / "pd_proxy.py")


def nixl(role: str, **extra) -> dict:
    return {"kv_connector": "DSV4NixlConnector", "kv_role": role, "kv_connector_extra_config": extra}


def server_args(ckpt, kv: dict) -> list[str]:
    shared_gpu = ["--gpu-memory-utilization", "0.3"] if torch.cuda.is_available() else []  # two servers, one GPU
    return ["-m", "vllm.entrypoints.openai.api_server", "--model", str(ckpt), *ENGINE_FLAGS, "--max-num-seqs", "8",
            "--max-logprobs", "1024", "--kv-transfer-config", json.dumps(kv), *shared_gpu]


@pytest.fixture(scope="module")
def pd(tiny_ckpt_unquantized, tmp_path_factory):
    work = tmp_path_factory.mktemp("pd_nixl")
    store = work / "store"
    decode_kv = {"kv_connector": "MultiConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                 "kv_connector_extra_config": {"connectors": [
                     nixl("kv_consumer"),
                     {"kv_connector": "DSV4Connector", "kv_role": "kv_both",
                      "kv_connector_extra_config": {"path": str(store)}}]}}

    def env():  # each engine's NIXL handshake listener on a port of its own
        return {"VLLM_PLUGINS": "vllm_dsv4", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}

    with vllm_server(server_args(tiny_ckpt_unquantized, nixl("kv_producer", kv_lease_duration=LEASE_S)), work,
                     env()) as (prefill, _), \
            vllm_server(server_args(tiny_ckpt_unquantized, decode_kv), work, env()) as (decode, _):
        with running_pd_proxy(prefill, decode, work) as base:
            yield SimpleNamespace(proxy=base, prefill=prefill, decode=decode, store=store, work=work)


@pytest.fixture(scope="module")
def reference(tiny_ckpt_unquantized):
    """(prompt, tokens) -> transformers' fp64 next-token log-probs [len(tokens), vocab] after prompt + tokens[:i]."""
    return functools.partial(forced_logprobs, load_hf_reference(tiny_ckpt_unquantized))


def completion(prompt: list[int], **extra) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "logprobs": 1024, "return_tokens_as_token_ids": True, **extra}


def post(base: str, body: dict) -> dict:
    answer = httpx.post(base + "/v1/completions", json=body, timeout=300)
    assert answer.status_code == 200, answer.text
    return answer.json()


def metric(base: str, name: str, label: str = "") -> float:
    """The sum of a Prometheus metric's samples (those whose labels include ``label``, e.g. 'source="x"')."""
    text = httpx.get(base + "/metrics", timeout=30).text
    samples = re.findall(rf"^{re.escape(name)}(?:{{([^}}]*)}})? (\S+)$", text, re.M)
    return sum(float(value) for labels, value in samples if label in labels)


PROMPT_SOURCES = ("local_compute", "external_kv_transfer")


def assert_matches_transformers(reference, prompt: list[int], answer: dict) -> None:
    choice = answer["choices"][0]
    tokens = choice["token_ids"]
    ref = reference(prompt, tokens)
    assert tokens == ref.argmax(-1).tolist()  # greedy, position by position
    assert len(tokens) == MAX_TOKENS
    for row, top in zip(ref, choice["logprobs"]["top_logprobs"]):  # the whole vocabulary at every position
        ids = torch.tensor([int(t.split(":")[1]) for t in top])
        ours = torch.tensor(list(top.values()), dtype=torch.float64)
        assert len(ids) == row.numel() and (ours - row[ids]).abs().max() <= LOGIT_TOL


def counters(base: str) -> dict[str, float]:
    """The decode server's prompt tokens by where they came from, and NIXL's bytes and failures."""
    found = {source: metric(base, "vllm:prompt_tokens_by_source_total", f'source="{source}"')
             for source in PROMPT_SOURCES}
    for name in ("vllm:nixl_bytes_transferred_sum", "vllm:nixl_num_failed_transfers_total"):
        found[name] = metric(base, name)
    return found


@pytest.fixture(scope="module")
def decoded(pd):
    """The eight prompts at once through the proxy, and how the decode server's counters moved."""
    before = counters(pd.decode)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = list(pool.map(lambda p: post(pd.proxy, completion(p)), PROMPTS))
    after = counters(pd.decode)
    return answers, {name: after[name] - before[name] for name in after}


def test_decode_server_matches_transformers_on_kv_taken_over_nixl(decoded, reference):
    """Every answer is transformers' on the whole prompt, and the decode server computed none of the
    prompts but their last tokens: vLLM counts a loaded prompt's tokens as transferred, the last one too
    (which it computes again, as any engine must to sample the next), except the one token of a one-token
    prompt. (A failed transfer would be recomputed, kv_load_failure_policy, and show here.)"""
    answers, moved = decoded
    for prompt, answer in zip(PROMPTS, answers):
        assert_matches_transformers(reference, prompt, answer)
    one_token = sum(len(p) == 1 for p in PROMPTS)
    assert moved["local_compute"] == one_token
    assert moved["external_kv_transfer"] == sum(map(len, PROMPTS)) - one_token
    assert moved["vllm:nixl_bytes_transferred_sum"] > 0 and moved["vllm:nixl_num_failed_transfers_total"] == 0


def test_next_turn_resumes_from_the_decode_servers_store(pd, decoded, tiny_ckpt_unquantized, reference):
    """A third engine (DSV4Connector on the decode server's store) given a conversation's next turn, the
    prompt and the decode server's answer followed by new text, resumes where the decode server stopped."""
    turns = [(p, a["choices"][0]["token_ids"]) for p, a in zip(PROMPTS, decoded[0]) if len(p) in (300, 700)]
    follow_ups = [p + out + extra for (p, out), extra in zip(turns, make_prompts([20, 20], seed=32))]
    engine = dict(ENGINE, kv_transfer_config={"kv_connector": "DSV4Connector", "kv_role": "kv_consumer",
                                              "kv_connector_extra_config": {"path": str(pd.store)}})
    result = run_vllm(pd.work, tiny_ckpt_unquantized, engine, [{"prompts": follow_ups, "logprobs": True,
                                                                "prompt_logprobs": False}], "next_turn")
    for (prompt, out), follow_up, ours in zip(turns, follow_ups, result["batches"][0]):
        assert ours["num_cached_tokens"] == len(prompt) + len(out) - 1  # where the decode server stopped
        ref = reference(follow_up, ours["tokens"])
        assert ours["tokens"] == ref.argmax(-1).tolist()
        assert (ours["logprobs"] - ref).abs().max() <= LOGIT_TOL


def test_prefill_server_frees_blocks_nobody_reads(pd):
    """A prefill whose decode never comes: vLLM keeps its blocks for the lease, then frees them."""
    idle = metric(pd.prefill, "vllm:kv_cache_usage_perc")
    body = kv_handoff.prefill_request(pd_proxy.prefill_body(completion(make_prompts([700], seed=33)[0])))
    answered = time.monotonic()
    assert post(pd.prefill, body)["kv_transfer_params"]["remote_block_ids"]
    assert metric(pd.prefill, "vllm:kv_cache_usage_perc") > idle  # held for the decode server
    while metric(pd.prefill, "vllm:kv_cache_usage_perc") > idle:
        assert time.monotonic() - answered < LEASE_S + 60, "the prefill server never freed the blocks"
        time.sleep(1)
    assert time.monotonic() - answered >= LEASE_S - 1  # not before the lease ran out
    assert metric(pd.prefill, "vllm:nixl_num_kv_expired_reqs_total") >= 1


@pytest.mark.skipif(compat.is_vllm_026(), reason="vLLM 0.26 cannot fail one request's KV load for a model with "
                    "several KV-cache groups (compat adapter 5): the decode engine stops")
def test_decode_server_recomputes_when_the_prefill_server_dies(pd, reference):
    """The prefill server answers, then dies before the decode server reads its blocks (last test: it
    stops the module's prefill server)."""
    prompt = make_prompts([300], seed=34)[0]
    first = post(pd.prefill, kv_handoff.prefill_request(pd_proxy.prefill_body(completion(prompt))))
    stop(RUNNING[pd.prefill])
    before = counters(pd.decode)
    answer = post(pd.decode, kv_handoff.decode_request(completion(prompt), json.dumps(first)))
    assert_matches_transformers(reference, prompt, answer)
    after = counters(pd.decode)
    assert after["vllm:nixl_num_failed_transfers_total"] - before["vllm:nixl_num_failed_transfers_total"] == 1
    assert after["local_compute"] - before["local_compute"] == len(prompt)  # recomputed
    again = make_prompts([129], seed=35)[0]
    assert_matches_transformers(reference, again, post(pd.decode, completion(again)))  # still serving
