"""The GPU path (Triton kernels and FlashMLA, bf16 activations, FP8 linears and MXFP4 experts kept quantised)
against our PyTorch reference path (``VLLM_DSV4_OPS=reference``: the csrc_triton references, fp32,
weights dequantised exactly) on the same FP8/MXFP4 checkpoint, both under vLLM.

The GPU engine generates 512 greedy tokens for 16 prompts whose lengths straddle C4 and C128 entry
boundaries; both engines then score prompt + those tokens (teacher forcing) and the next-token
distributions at the 512 generated positions are compared.

Tolerance. Both paths use the same (dequantised) weights, so the difference comes from activations:
FP8 e4m3 per-128-group quantisation before every FP8 linear (relative rounding error up to 2^-4,
RMS about 2^-4/sqrt(12) ~ 1.8% per element, independent across the K summands, so a dot product's
relative error is of that order, not K times it), bf16 storage (2^-9 relative) of activations, and
FP8 KV: both paths store it with the same codec, so a cached value differs only where the two
paths' inputs fall on either side of an e4m3 rounding boundary (~2%/2^-3 of values, one e4m3 step
each: ~5% RMS on a key). About seven such quantisations on a layer's path put its relative error near
sqrt(7) x 1.8% plus the keys' share; we bound it by ``NOISE_PER_LAYER`` = 0.06, and the logits'
relative error by eps = 0.06 sqrt(layers) (independent layers add in quadrature).

What eps means for the metrics depends on the logits. With these random weights they are close to
i.i.d. N(0, 1) over the vocabulary (head N(0, 1/D) on RMS-normed states), which the reference's
top-1 margins confirm: the share of positions with a margin > 0.5 nats was 18% for ktiny's 1,024
tokens and 10% for V4-Flash's 129k (on an H200), where that model gives 17-19% and 9-12%. So
the thresholds are that model's expectations at eps (``noise_model``): N(0, 1) logits plus
independent N(0, eps^2) noise give the mean cosine of the two probability vectors (over each side's
top-k where only the top-k is returned: for 129k near-flat logits that is mostly the overlap of the
two top-64 sets, far below the full vectors' cosine) and the top-1 agreement; the measured values
must reach them. Measured on an H200: ktiny (4 layers, eps bound 0.12, where the model gives
cosine 0.993, top-1 0.80) cosine 0.9955, top-1 0.869; V4-Flash dims (6 layers, bound 0.147: about
0.87 and 0.66 on top-64) 0.893 and 0.746, which the model matches at eps ~ 0.12 (and ktiny at
~0.09). The argmax must also agree where the reference is decisive: at positions whose top-1 margin
exceeds ``DECISIVE_NATS`` = 0.5 nats, >= 99% (the model gives >= 99% up to eps ~ 0.15; measured
0.997 and 0.995). The minimum cosine is printed, not asserted: it is set by flips at near-ties.

Kernel compiles: none while serving (every variant serving needs compiles before the engine is ready).

CUDA graphs: a generation of 128 tokens with decode steps replayed from full CUDA graphs (capture
sizes up to the batch of 16, so the all-decode steps run the same kernels on the same shapes as
eager) must give the same tokens and log-probs as eager in batch-invariant mode
(``VLLM_DSV4_BATCH_INVARIANT=1``: our Triton MoE); so must a chunked-prefill generation whose mixed
and prefill steps replay piecewise graphs. By default the routed experts run vLLM's Marlin MoE, whose
rows move by one bf16 rounding (2^-8 relative) with the padding rows a graph adds to a batch
(tests/model/test_graph_replay.py). Every FP8 quantiser downstream (the activations before each FP8
linear, the FP8 KV entries) re-rounds a value so moved with probability about 2^-8 / 2^-3.5 (its share
of an e4m3 step) by a whole e4m3 step (2^-3.5 relative): an RMS change near 1.9%, the size of the FP8
quantisation error itself. So graph and eager may part by up to one more quantisation error per
quantiser, the noise the GPU path is allowed against the reference path: their logits' relative
difference, measured up to each prompt's first different token, must stay within eps above. A replay
bug (a frozen plan, a stale length, a wrong slot) moves logits by O(1), far past it.
"""

import json
import os
from pathlib import Path

import pytest
import torch

from tests.e2e.test_generate import make_prompts, run_vllm

pytestmark = [pytest.mark.e2e, pytest.mark.gpu]

PROMPT_LENS = (3, 4, 5, 127, 128, 129, 255, 256, 257, 300, 511, 512, 513, 700, 1000, 1200)
NEW_TOKENS = 512
GRAPH_TOKENS = 128  # decode steps of the CUDA-graph comparisons (each replays every layer's graph code)
NOISE_PER_LAYER, DECISIVE_NATS, DECISIVE_TOP1_MIN = 0.06, 0.5, 0.99
PROMPTS = make_prompts(PROMPT_LENS, seed=3)
FLASH_TOP_K = 64
# At V4-Flash dims the indexer keeps index_topk = 512 C4 entries: only past 4 x 512 = 2,048 tokens does it
# select, so two of the prompts there are longer (with their 512 generated tokens, up to 4,512 positions).
FLASH_PROMPT_LENS = PROMPT_LENS[:-2] + (3000, 4000)
# FP8 KV on both paths (the same codec, the KV the model was trained to see); on Hopper the GPU path's
# attention then runs FlashMLA's sparse kernel on those caches.
ENGINE = dict(max_model_len=2048, max_num_seqs=16, max_num_batched_tokens=4096, gpu_memory_utilization=0.3,
              kv_cache_dtype="fp8")


def scored_logprobs(result: dict, batch: int) -> list[torch.Tensor]:
    """Per prompt of a teacher-forced batch run with ``score_last=NEW_TOKENS``, the [NEW_TOKENS, V]
    log-probs of the generated positions (row i scores token i+1 given tokens 0..i)."""
    return [r["prompt_logprobs"] for r in result["batches"][batch]]


@pytest.fixture(scope="module")
def gpu_eager(tmp_path_factory, ktiny_ckpt):
    """The GPU path, eager: greedy generation with log-probs, then the same prompts + tokens scored."""
    batches = [{"prompts": PROMPTS, "logprobs": True, "prompt_logprobs": False},
               {"prompts": PROMPTS, "extend_with_batch": 0, "logprobs": True, "score_last": NEW_TOKENS}]
    return run_vllm(tmp_path_factory.mktemp("gpu"), ktiny_ckpt, dict(ENGINE, dtype="bfloat16"), batches, "gpu",
                    max_tokens=NEW_TOKENS)


@pytest.fixture(scope="module")
def both_paths(tmp_path_factory, ktiny_ckpt, gpu_eager):
    """(GPU path's greedy tokens, its scores of them, the reference path's scores of them)."""
    tokens = [r["tokens"] for r in gpu_eager["batches"][0]]
    forced = [{"prompts": [p + t for p, t in zip(PROMPTS, tokens)], "logprobs": True, "score_last": NEW_TOKENS}]
    ref = run_vllm(tmp_path_factory.mktemp("ref"), ktiny_ckpt, dict(ENGINE, dtype="float32"), forced, "ref",
                   env={"VLLM_DSV4_OPS": "reference"}, max_tokens=1)
    return tokens, scored_logprobs(gpu_eager, 1), scored_logprobs(ref, 0)


DECODE_JOB = [{"prompts": PROMPTS, "logprobs": True, "prompt_logprobs": False}]


BATCH_INVARIANT = {"VLLM_DSV4_BATCH_INVARIANT": "1"}
DECODE_GRAPHS = dict(enforce_eager=False,
                     compilation_config={"cudagraph_mode": "FULL_DECODE_ONLY", "max_cudagraph_capture_size": 16})


def decode_run(tmp_path_factory, ckpt, name: str, options: dict | None = None, env: dict | None = None,
               **engine) -> list[dict]:
    """GRAPH_TOKENS greedy tokens with log-probs for each prompt, bf16, eager unless ``engine`` says;
    ``options``: run_vllm.py's job options; ``env``: the engine's extra environment."""
    return run_vllm(tmp_path_factory.mktemp(name), ckpt, dict(ENGINE, dtype="bfloat16", **engine), DECODE_JOB, name,
                    env=env, max_tokens=GRAPH_TOKENS, **(options or {}))["batches"][0]


@pytest.fixture(scope="module")
def decode_eager(tmp_path_factory, ktiny_ckpt):
    return decode_run(tmp_path_factory, ktiny_ckpt, "decode_eager")


@pytest.fixture(scope="module")
def decode_eager_invariant(tmp_path_factory, ktiny_ckpt):
    return decode_run(tmp_path_factory, ktiny_ckpt, "decode_eager_invariant", env=BATCH_INVARIANT)


def first_difference(run: dict, reference: dict) -> int | None:
    """The first step whose token differs between two generations of one prompt (None: none does)."""
    return next((j for j, (a, b) in enumerate(zip(run["tokens"], reference["tokens"])) if a != b), None)


def assert_same_generation(runs: list[dict], reference: list[dict], what: str) -> None:
    worst = max(float((g["logprobs"] - e["logprobs"]).abs().max()) for g, e in zip(runs, reference))
    print(f"{what}: max |logprob difference| {worst:.3g} over {len(PROMPTS)} x {GRAPH_TOKENS} steps")
    # Where the token streams part, the steps up to the first different token still condition on the
    # same prefix: how far apart those are tells a replay bug (large) from order-of-summation noise
    # (which FP8 KV amplifies: a flipped e4m3 rounding moves a value by up to 1/16).
    for i, (g, e) in enumerate(zip(runs, reference)):
        same = first_difference(g, e)
        if same is not None:
            before = float((g["logprobs"][: same + 1] - e["logprobs"][: same + 1]).abs().max())
            print(f"prompt {i}: first different token at step {same}; max |logprob difference| up to it {before:.3g}")
    assert [g["tokens"] for g in runs] == [e["tokens"] for e in reference]
    assert worst <= 1e-5


def test_eager_decode_is_reproducible(tmp_path_factory, ktiny_ckpt, decode_eager):
    """Two eager runs give the same bits: what the CUDA-graph comparison below relies on (a kernel whose
    reductions vary between runs fails here, not there)."""
    assert_same_generation(decode_run(tmp_path_factory, ktiny_ckpt, "decode_eager_again"), decode_eager,
                           "eager vs eager")


def test_eager_decode_ignores_unwritten_memory(tmp_path_factory, ktiny_ckpt, decode_eager):
    """Every cache page filled with garbage first (what pages freed by other requests hold), and every
    buffer allocated after it with NaN: the same bits, so no kernel of the GPU path reads an FP8 entry,
    scale, state row or temporary before writing it. (Where memory is laid out differently, e.g. in a
    CUDA graph's pool or with other MoE kernels, such a read would show as graphs and eager parting.)"""
    options = {"poison_kv_cache": True, "fill_uninitialized_memory": True}
    assert_same_generation(decode_run(tmp_path_factory, ktiny_ckpt, "decode_unwritten", options), decode_eager,
                           "unwritten memory filled vs not")


def test_cuda_graph_decode_matches_eager(tmp_path_factory, ktiny_ckpt, decode_eager_invariant):
    """Batch-invariant mode: graph decode repeats eager bit for bit."""
    graphs = decode_run(tmp_path_factory, ktiny_ckpt, "graphs_invariant", env=BATCH_INVARIANT, **DECODE_GRAPHS)
    assert_same_generation(graphs, decode_eager_invariant, "CUDA graphs vs eager, batch-invariant")


def logit_difference(runs: list[dict], reference: list[dict]) -> float:
    """The relative difference of two generations' logits (each row's log-probs less their mean: the
    logits up to a constant) over every step up to each prompt's first different token, where both
    condition on the same tokens: ||a - b|| / ||b|| over all those rows."""
    diff = norm = 0.0
    for g, e in zip(runs, reference):
        parted = first_difference(g, e)
        steps = len(e["tokens"]) if parted is None else parted + 1
        a, b = (dense_rows(r["logprobs"][:steps]).double() for r in (g, e))
        a, b = a - a.mean(-1, keepdim=True), b - b.mean(-1, keepdim=True)
        diff, norm = diff + float(((a - b) ** 2).sum()), norm + float((b**2).sum())
    return (diff / norm) ** 0.5


def test_cuda_graph_decode_close_to_eager(tmp_path_factory, ktiny_ckpt, decode_eager):
    """The default (Marlin MoE): graph decode within the module doc's eps of eager."""
    graphs = decode_run(tmp_path_factory, ktiny_ckpt, "graphs", **DECODE_GRAPHS)
    config = json.loads((ktiny_ckpt / "config.json").read_text())
    eps = NOISE_PER_LAYER * config["num_hidden_layers"] ** 0.5
    parted = [first_difference(g, e) for g, e in zip(graphs, decode_eager)]
    measured = logit_difference(graphs, decode_eager)
    print(f"CUDA graphs vs eager: relative logit difference {measured:.3g} (bound {eps:.3g}); first different "
          f"token per prompt: {parted}")
    assert measured <= eps


PIECEWISE_ENGINE = dict(ENGINE, dtype="bfloat16", max_num_batched_tokens=64, enable_chunked_prefill=True)
PIECEWISE_JOB = [{"prompts": PROMPTS, "logprobs": True, "prompt_logprobs": False}]


@pytest.fixture(scope="module")
def piecewise_eager(tmp_path_factory, ktiny_ckpt):
    """Chunked prefill in 64-token steps, eager: what the piecewise-graph runs are compared with."""
    return run_vllm(tmp_path_factory.mktemp("pw_eager"), ktiny_ckpt, PIECEWISE_ENGINE, PIECEWISE_JOB, "pw_eager",
                    max_tokens=64)["batches"][0]


def piecewise_run(tmp_path_factory, ktiny_ckpt, name: str, capture_sizes: list[int]) -> list[dict]:
    """The same generation with mixed and prefill steps replayed from piecewise (breakable) CUDA graphs."""
    run = run_vllm(tmp_path_factory.mktemp(name), ktiny_ckpt,
                   dict(PIECEWISE_ENGINE, enforce_eager=False,
                        compilation_config={"cudagraph_mode": "FULL_AND_PIECEWISE",
                                            "cudagraph_capture_sizes": capture_sizes}),
                   PIECEWISE_JOB, name, env={"VLLM_USE_BREAKABLE_CUDAGRAPH": "1"}, max_tokens=64)
    assert "Breakable CUDA graph enabled" in run["log"] and "PIECEWISE" in run["log"]
    return run["batches"][0]


def test_piecewise_graphs_match_eager(tmp_path_factory, ktiny_ckpt, piecewise_eager):
    """Chunked prefill in 64-token steps, so mixed and prefill steps fit the captured sizes, replayed
    from piecewise CUDA graphs (vLLM's breakable graphs: captured segments around our attention,
    which runs eagerly with the step's metadata) against eager. Every step size up to 64 is captured,
    so no step is padded and each runs the kernels eager runs on the same shapes: tokens and
    log-probs must be identical."""
    graphs = piecewise_run(tmp_path_factory, ktiny_ckpt, "pw_graphs", list(range(1, 65)))
    worst = max(float((g["logprobs"] - e["logprobs"]).abs().max()) for g, e in zip(graphs, piecewise_eager))
    print(f"piecewise CUDA graphs vs eager: max |logprob difference| {worst:.3g} over {len(PROMPTS)} x 64 steps")
    assert [g["tokens"] for g in graphs] == [e["tokens"] for e in piecewise_eager]
    assert worst == 0


def test_no_kernel_compiles_while_serving(tmp_path_factory, ktiny_ckpt):
    """Our Triton kernels compile before the engine is ready (vLLM's warm-up and graph capture, then
    warmup.py's steps), none while it serves: one short prefill alone, then prefills of lengths
    no warm-up step has (odd ones, past the largest step) batched with each other and with decodes,
    decode steps of captured sizes (replayed) and of others (eager), a prompt past 2,000 tokens."""
    batches = [{"prompts": make_prompts((3,), seed=7)}, {"prompts": make_prompts((17, 100, 777, 1000, 1500, 5), seed=8)},
               {"prompts": make_prompts((2001,), seed=9)}]
    engine = dict(ENGINE, dtype="bfloat16", enforce_eager=False,
                  compilation_config={"cudagraph_mode": "FULL_DECODE_ONLY", "max_cudagraph_capture_size": 4})
    result = run_vllm(tmp_path_factory.mktemp("compiles"), ktiny_ckpt, engine, batches, "compiles", max_tokens=8,
                      count_kernel_compiles=True)
    compiles = result["kernel_compiles"]
    print(f"{len(compiles['before_ready'])} compiles of our kernels before ready")
    assert compiles["before_ready"]  # the hook sees the engine's compiles
    assert compiles["batches"] == [[]] * len(batches), compiles["batches"]


def test_piecewise_graphs_pad_steps(tmp_path_factory, ktiny_ckpt, piecewise_eager):
    """Captured sizes 16, 32, 64 only: most steps are padded to the next size, their padding rows
    running through the graphs while attention sees the step's real tokens only. The padded GEMMs
    may pick other kernels than eager's, so outputs are close, not identical: up to each prompt's
    first different token (tokens part only at near-ties) the log-probs stay within 0.05."""
    graphs = piecewise_run(tmp_path_factory, ktiny_ckpt, "pw_padded", [16, 32, 64])
    for i, (g, e) in enumerate(zip(graphs, piecewise_eager)):
        assert len(g["tokens"]) == len(e["tokens"]), i
        same = next((j for j, (a, b) in enumerate(zip(g["tokens"], e["tokens"])) if a != b), len(g["tokens"]) - 1)
        gap = float((g["logprobs"][: same + 1] - e["logprobs"][: same + 1]).abs().max())
        print(f"prompt {i}: same tokens up to step {same}; max |logprob difference| up to it {gap:.3g}")
        assert gap <= 0.05, (i, same, gap)


def dense_rows(rows: torch.Tensor) -> torch.Tensor:
    """Sparse top-k log-prob rows -> dense, -inf where a token was not returned (dense rows as they are)."""
    if not rows.is_sparse:
        return rows
    out = torch.full(rows.shape, float("-inf"), dtype=rows.dtype)
    index = rows.indices()
    out[index[0], index[1]] = rows.values()
    return out


def noise_model(vocab: int, top_k: int | None, eps: float) -> tuple[float, float]:
    """(mean cosine, top-1 agreement) between the probability vectors of N(0, 1) logits and of the same
    logits plus N(0, eps^2) noise, i.i.d. over ``vocab`` tokens; with ``top_k``, each vector keeps only
    its own top-k probabilities, as vLLM returns them. 4M logits at least (1,024 rows), in 128-row chunks."""
    g = torch.Generator().manual_seed(0)
    cosines, agree = [], []
    for _ in range(max(8, (1 << 22) // (128 * vocab))):
        exact = torch.randn(128, vocab, generator=g)
        noisy = exact + eps * torch.randn(128, vocab, generator=g)
        probs = []
        for logits in (exact, noisy):
            p = logits.softmax(-1)
            if top_k:
                p = torch.zeros_like(p).scatter_(1, *reversed(p.topk(top_k, dim=-1)))
            probs.append(p)
        cosines.append(torch.nn.functional.cosine_similarity(*probs, dim=-1))
        agree.append(exact.argmax(-1) == noisy.argmax(-1))
    return torch.cat(cosines).mean().item(), torch.cat(agree).float().mean().item()


def agreement(tokens: list[list[int]], ours: list[torch.Tensor], theirs: list[torch.Tensor], what: str,
              checkpoint: Path, top_k: int | None = None) -> None:
    """Per prompt: the GPU path's greedy tokens and its [N, V] log-probs against the reference path's at
    the same positions; prints the numbers and asserts the module doc's criteria for the checkpoint's
    vocabulary and layer count. Over top-k rows the cosine compares the probabilities both paths
    returned (a token missing from one side's top-k counts as probability 0 there)."""
    cosines, agree, decisive = [], [], []
    for toks, a, b in zip(tokens, ours, theirs):
        a, b = dense_rows(a), dense_rows(b)  # one prompt at a time: 512 dense V4-Flash rows are 0.5 GB
        assert a.shape == b.shape == (len(toks), a.shape[1])
        cosines.append(torch.nn.functional.cosine_similarity(a.exp(), b.exp(), dim=-1))
        agree.append(b.argmax(-1) == torch.tensor(toks))
        top2 = b.topk(2, dim=-1).values  # [N, 2] the reference's two best log-probs
        decisive.append(top2[:, 0] - top2[:, 1] > DECISIVE_NATS)
    cos, agree, decisive = torch.cat(cosines), torch.cat(agree), torch.cat(decisive)
    top1, n_decisive = agree.double().mean().item(), int(decisive.sum())
    decisive_top1 = int((agree & decisive).sum()) / max(n_decisive, 1)
    config = json.loads((checkpoint / "config.json").read_text())
    eps = NOISE_PER_LAYER * config["num_hidden_layers"] ** 0.5
    cos_min, top1_min = noise_model(config["vocab_size"], top_k, eps)
    print(f"GPU vs reference path ({what}): cosine min {cos.min():.5f} mean {cos.mean():.5f}; top-1 agreement "
          f"{top1:.4f} over {agree.numel()} positions, {decisive_top1:.4f} over the {n_decisive} with a reference "
          f"margin > {DECISIVE_NATS} nats; noise model at eps {eps:.3f}: cosine {cos_min:.4f}, top-1 {top1_min:.4f}")
    assert n_decisive > 0
    assert decisive_top1 >= DECISIVE_TOP1_MIN
    assert cos.mean() >= cos_min
    assert top1 >= top1_min


def test_gpu_path_matches_reference_path(both_paths, ktiny_ckpt):
    agreement(*both_paths, "ktiny", ktiny_ckpt)


@pytest.fixture(scope="module")
def flash_ckpt(tmp_path_factory, make_checkpoint_module):
    """Real V4-Flash dimensions, 6 layers (2 SWA, 2 C4, 2 C128; the first 3 hash-routed), FP8 + MXFP4,
    drawn on the GPU (~1 min); ``DSV4_FLASH_CKPT`` names one already made."""
    return _flash_dims(tmp_path_factory, make_checkpoint_module, "flash", "DSV4_FLASH_CKPT")


@pytest.fixture(scope="module")
def flash_base_ckpt(tmp_path_factory, make_checkpoint_module):
    """V4-Flash-Base's format (FP8 routed experts, float32 scales) at V4-Flash dimensions, 4 layers (2 SWA,
    C4, C128; 3 hash-routed: its FP8 experts are 25 GB); ``DSV4_FLASH_BASE_CKPT`` names one already made."""
    return _flash_dims(tmp_path_factory, make_checkpoint_module, "flash-base", "DSV4_FLASH_BASE_CKPT", num_layers=4)


def _flash_dims(tmp_path_factory, make_checkpoint_module, preset: str, env: str, **options) -> Path:
    made = os.environ.get(env)
    if made and (Path(made) / "config.json").exists():
        return Path(made)
    return make_checkpoint_module.make_checkpoint(tmp_path_factory.mktemp(preset), preset, seed=0, device="cuda",
                                                  **options)


@pytest.mark.parametrize("checkpoint", ["flash_ckpt", "flash_base_ckpt"])
def test_flash_dims_gpu_path_matches_reference_path(request, tmp_path_factory, checkpoint):
    """The same comparison at V4-Flash layer dimensions (64 heads of 512, 129k vocabulary, 256 experts,
    top-512 indexer, selecting in the two prompts past 2,048 tokens) on top-FLASH_TOP_K log-probs (the full vocabulary would be 16 x 512 x 129k values),
    with the module doc's criteria for the checkpoint's layers and top-k rows; in the release format
    (MXFP4 experts) and in V4-Flash-Base's (FP8 experts on our FP8 MoE)."""
    flash_ckpt = request.getfixturevalue(checkpoint)
    prompts = make_prompts(FLASH_PROMPT_LENS, seed=4, vocab=100_000)
    engine = dict(ENGINE, gpu_memory_utilization=0.6, max_model_len=8192, max_num_batched_tokens=8192)
    batches = [{"prompts": prompts, "logprobs": FLASH_TOP_K, "prompt_logprobs": False},
               {"prompts": prompts, "extend_with_batch": 0, "logprobs": FLASH_TOP_K, "score_last": NEW_TOKENS}]
    gpu = run_vllm(tmp_path_factory.mktemp("flash_gpu"), flash_ckpt, dict(engine, dtype="bfloat16"), batches,
                   "flash_gpu", max_tokens=NEW_TOKENS)
    tokens = [r["tokens"] for r in gpu["batches"][0]]
    forced = [{"prompts": [p + t for p, t in zip(prompts, tokens)], "logprobs": FLASH_TOP_K,
               "score_last": NEW_TOKENS}]
    ref = run_vllm(tmp_path_factory.mktemp("flash_ref"), flash_ckpt, dict(engine, dtype="float32"), forced,
                   "flash_ref", env={"VLLM_DSV4_OPS": "reference"}, max_tokens=1)
    agreement(tokens, scored_logprobs(gpu, 1), scored_logprobs(ref, 0), f"V4-Flash dims, top-{FLASH_TOP_K}",
              flash_ckpt, top_k=FLASH_TOP_K)
