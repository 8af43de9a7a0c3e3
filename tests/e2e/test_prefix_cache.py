"""Prefix caching: a request whose prompt starts with an earlier request's blocks reuses them (every
cache component of those blocks: window KV, compressed entries, indexer keys, compressor states) and
generates exactly what transformers generates from the whole prompt."""

import pytest
import torch

from tests.e2e.test_generate import ENGINE, LOGIT_TOL, MAX_TOKENS, make_prompts, run_vllm
from tests.oracle.hf_oracle import load_hf_reference

pytestmark = pytest.mark.e2e

BLOCK = 256  # the cache block (patches.py sets it for DSV4); hits are whole blocks
PREFIX = make_prompts([700], seed=4)[0]
# Suffixes after the shared 700 tokens; the last prompt shares only 600 (a hit of 512 that ends
# inside a C4 window pair and a C128 window, recomputing 88 shared tokens).
PROMPTS = [PREFIX + s for s in make_prompts([5, 77, 300], seed=5)] + [PREFIX[:600] + make_prompts([41], seed=6)[0]]


@pytest.fixture(scope="module")
def cached_run(tmp_path_factory, tiny_ckpt_unquantized):
    engine = dict(ENGINE, max_model_len=2048, max_num_batched_tokens=4096, enable_prefix_caching=True)
    batches = [{"prompts": [p], "logprobs": True, "prompt_logprobs": False} for p in PROMPTS]  # one at a time
    return run_vllm(tmp_path_factory.mktemp("prefix"), tiny_ckpt_unquantized, engine, batches, "prefix")


def test_later_requests_hit_the_shared_blocks(cached_run):
    cached = [b[0]["num_cached_tokens"] for b in cached_run["batches"]]
    assert cached == [0, 2 * BLOCK, 2 * BLOCK, 2 * BLOCK]


def test_outputs_with_cache_hits_match_transformers(cached_run, tiny_ckpt_unquantized):
    model = load_hf_reference(tiny_ckpt_unquantized)
    with torch.no_grad():
        for prompt, (ours,) in zip(PROMPTS, cached_run["batches"]):
            full = torch.tensor([prompt + ours["tokens"]])
            logprobs = torch.log_softmax(model(full).logits[0].double(), -1)[len(prompt) - 1 : -1]  # [MAX_TOKENS, V]
            assert ours["tokens"] == logprobs.argmax(-1).tolist()  # greedy, position by position
            assert ours["logprobs"].shape == (MAX_TOKENS, logprobs.shape[1])
            assert (ours["logprobs"] - logprobs).abs().max() <= LOGIT_TOL
