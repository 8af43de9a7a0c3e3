"""Disaggregated prefill as users run it: a kv_producer and a kv_consumer OpenAI server sharing a
DSV4Connector store, behind scripts/pd_proxy.py. The decode server's answers are checked against
transformers' greedy continuation, and its metrics show it took the prompt from the store."""

import json
import re

import httpx
import pytest

from tests.e2e.test_generate import make_prompts
from tests.oracle.hf_oracle import greedy_sequence, load_hf_reference
from tests.serving.conftest import ENGINE_FLAGS, running_pd_proxy, vllm_server

pytestmark = pytest.mark.e2e

PROMPT = make_prompts([600], seed=21)[0]
MAX_TOKENS = 16


def server_args(ckpt, store, role: str) -> list[str]:
    kv = {"kv_connector": "DSV4Connector", "kv_role": role, "kv_connector_extra_config": {"path": str(store)}}
    return ["-m", "vllm.entrypoints.openai.api_server", "--model", str(ckpt), *ENGINE_FLAGS,
            "--kv-transfer-config", json.dumps(kv)]


@pytest.fixture(scope="module")
def pd(tiny_ckpt_unquantized, tmp_path_factory):
    work = tmp_path_factory.mktemp("pd")
    store, env = work / "store", {"VLLM_PLUGINS": "vllm_dsv4"}
    with vllm_server(server_args(tiny_ckpt_unquantized, store, "kv_producer"), work, env) as (prefill, _), \
            vllm_server(server_args(tiny_ckpt_unquantized, store, "kv_consumer"), work, env) as (decode, _):
        with running_pd_proxy(prefill, decode, work) as base:
            yield base, decode, store


@pytest.fixture(scope="module")
def greedy(tiny_ckpt_unquantized) -> list[int]:
    return greedy_sequence(load_hf_reference(tiny_ckpt_unquantized), PROMPT, MAX_TOKENS)[len(PROMPT):]


def complete(base: str, **extra) -> httpx.Response:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **extra}
    return httpx.post(base + "/v1/completions", json=body, timeout=300)


def metric(base: str, name: str) -> float:
    text = httpx.get(base + "/metrics", timeout=30).text
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def test_decode_through_the_proxy_matches_transformers(pd, greedy):
    proxy, decode, store = pd
    answer = complete(proxy, min_tokens=MAX_TOKENS)  # more than the prefill leg's one token
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["token_ids"] == greedy
    assert len(list(store.rglob("*.kv"))) == 3  # history at 256 and 512, the window entry at 599
    assert metric(decode, "vllm:external_prefix_cache_hits_total") == len(PROMPT) - 1


def test_streamed_decode_through_the_proxy(pd):
    proxy, _, _ = pd
    whole = complete(proxy).json()["choices"][0]["text"]
    with httpx.stream("POST", proxy + "/v1/completions", timeout=300,
                      json={"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
                            "ignore_eos": True, "stream": True}) as answer:
        events = [line[6:] for line in answer.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == whole


def test_a_bad_request_gets_the_prefill_servers_error(pd):
    proxy, _, _ = pd
    answer = complete(proxy, prompt=list(range(5000)))  # longer than max_model_len
    assert answer.status_code == 400 and "maximum" in answer.text.lower()
    assert complete(proxy).status_code == 200  # still serving
