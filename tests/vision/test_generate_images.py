"""Prompts with images through vLLM (CPU, fp32, ``tiny-vision``) against the pure-PyTorch reference of
the whole model (tests/vision/reference.py): the expanded prompt, greedy tokens and every log-prob.

One engine with prefix caching and whole-prompt steps, one with chunked prefill at steps of the
largest block (384 tokens) placed so that steps would cut images; a resend of an image hits the
prefix cache, another image of the same size does not, and a hit that would end inside an image is
moved back to before it. One engine drafts with DSpark (Vision-Exp's recipe, 3 tokens): its drafts
equal those of a drafter written from the spec (tests/oracle/dspark_ref.py) fed the reference's
features."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.e2e.test_dspark import SHORTEST
from tests.e2e.test_generate import LOGIT_TOL, make_prompts, runner_env

pytestmark = pytest.mark.e2e

RUNNER = Path(__file__).with_name("run_vision.py")
PLACEHOLDER_ID = 129262  # <｜deepseek_image｜> in the tiny-vision tokenizer
SENTINEL_BASE = 129257  # the five image sentinel ids follow
BOS = 0
MAX_TOKENS = 8
BLOCK = 256  # prefix-cache granularity
CHUNK = 384  # the smallest step the engine allows (vision_max_n_token)
DRAFTS = max(3, SHORTEST)  # DeepSeek's Vision-Exp recipe drafts 3 (vLLM 0.26 refuses fewer than the block size)
DRAFTED = ("image_last", "two")  # the cases served with drafting


def image_file(tmp: Path, name: str, size: tuple[int, int], seed: int) -> str:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    path = tmp / f"{name}.png"
    Image.fromarray(pixels).save(path)
    return str(path)


def prompt(pieces: list, seed: int) -> list[int]:
    """BOS, then each piece: an int n is n random text tokens, None an image placeholder."""
    ids, texts = [BOS], iter(make_prompts([p for p in pieces if p is not None], seed=seed))
    for piece in pieces:
        ids += [PLACEHOLDER_ID] if piece is None else next(texts)
    return ids


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, make_checkpoint_module) -> Path:
    return make_checkpoint_module.make_checkpoint(tmp_path_factory.mktemp("tiny_vision"), "tiny-vision",
                                                  quantized=False, seed=0)


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> dict[str, str]:
    tmp = tmp_path_factory.mktemp("images")
    return {"a": image_file(tmp, "a", (224, 224), 1),  # 114-token block
            "a2": image_file(tmp, "a2", (224, 224), 2),  # same size, other pixels
            "wide": image_file(tmp, "wide", (500, 130), 3),  # odd LLM rows
            "tall": image_file(tmp, "tall", (90, 300), 4)}


# name -> (prompt ids, images). "one"'s image ends inside the first cache block; "hit_split" is short
# enough that its longest cache hit (one block) would end inside its image; "chunk_split" and "chunks"
# have images across a 384-token step boundary; "image_last"'s image ends within the 16-token window
# a DSpark draft step sees before its anchor.
def cases(images):
    return {
        "one": (prompt([20, None, 200], 11), [images["a"]]),
        "two": (prompt([7, None, 30, None, 40], 12), [images["wide"], images["tall"]]),
        "hit_split": (prompt([230, None, 20], 13), [images["a"]]),
        "chunk_split": (prompt([300, None, 100], 15), [images["a"]]),
        "chunks": (prompt([330, None, 20, None, 150], 14), [images["tall"], images["a2"]]),
        "image_last": (prompt([20, None, 3], 16), [images["a"]]),
    }


def run(tmp: Path, ckpt: Path, engine: dict, batches: list[list[dict]], name: str, env: dict | None = None,
        **options) -> dict:
    """run_vision.py's output (``batches``: per batch, per prompt; ``spec_decode``; ``draft_rows``).
    ``options``: run_vision.py's ``record_drafts``."""
    defaults = dict(dtype="float32", max_model_len=2048)
    if torch.cuda.is_available():  # the same tests run on the GPU device under vLLM 0.26
        defaults["gpu_memory_utilization"] = 0.3
    job = {"model": str(ckpt), "engine": {**defaults, **engine}, "batches": batches, "max_tokens": MAX_TOKENS,
           **options}
    job_path, out_path = tmp / f"{name}.json", tmp / f"{name}.pt"
    job_path.write_text(json.dumps(job))
    repo = Path(__file__).resolve().parents[2]
    env = dict(runner_env(), PYTHONPATH=str(repo), **(env or {}))
    proc = subprocess.run([sys.executable, str(RUNNER), str(job_path), str(out_path)], env=env, cwd=tmp,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, f"vLLM run {name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return torch.load(out_path, weights_only=False)


@pytest.fixture(scope="module")
def whole_steps(tmp_path_factory, ckpt, images):
    c = cases(images)
    p = lambda name: {"ids": c[name][0], "images": c[name][1]}  # noqa: E731
    other = {"ids": c["one"][0], "images": [images["a2"]]}
    batches = [[p("one")], [p("two")], [p("one")], [other], [p("hit_split")], [p("hit_split")]]
    return run(tmp_path_factory.mktemp("whole"), ckpt, dict(enable_prefix_caching=True, max_num_batched_tokens=2048),
               batches, "whole")["batches"]


@pytest.fixture(scope="module")
def chunked(tmp_path_factory, ckpt, images):
    c = cases(images)
    batches = [[{"ids": c[n][0], "images": c[n][1]} for n in ("chunk_split", "chunks", "two")]]
    return run(tmp_path_factory.mktemp("chunked"), ckpt,
               dict(enable_prefix_caching=False, enable_chunked_prefill=True, max_num_batched_tokens=CHUNK,
                    max_num_seqs=1), batches, "chunked")["batches"]


@pytest.fixture(scope="module")
def drafted(tmp_path_factory, ckpt, images):
    """One batch of a one- and a two-image prompt with DSpark drafting (tiny-vision carries 0731's
    stages), every draft step recorded."""
    c = cases(images)
    batches = [[{"ids": c[n][0], "images": c[n][1]} for n in DRAFTED]]
    spec = {"method": "dspark", "num_speculative_tokens": DRAFTS}
    return run(tmp_path_factory.mktemp("drafted"), ckpt, dict(speculative_config=spec, max_num_batched_tokens=2048),
               batches, "drafted", record_drafts=True)


@pytest.fixture(scope="module")
def reference(ckpt):
    from tests.vision.reference import VisionReference

    return VisionReference(ckpt)


def check(reference, case, ours):
    ids, files = case
    expanded = reference.expand(ids, [Image.open(f) for f in files], PLACEHOLDER_ID)
    assert ours["prompt_token_ids"] == expanded.ids
    logprobs = reference.logprobs(expanded, ours["tokens"])[len(expanded.ids) - 1: -1]  # [MAX_TOKENS, V]
    assert ours["tokens"] == logprobs.argmax(-1).tolist()
    assert (ours["logprobs"] - logprobs).abs().max() <= LOGIT_TOL
    return expanded


def test_one_and_two_images_match_the_reference(whole_steps, reference, images):
    c = cases(images)
    one = check(reference, c["one"], whole_steps[0][0])
    assert one.blocks[0][1] < BLOCK  # the image lies in the first cache block
    two = check(reference, c["two"], whole_steps[1][0])
    assert len(two.blocks) == 2


def test_resent_image_hits_the_prefix_cache(whole_steps, reference, images):
    first, again = whole_steps[0][0], whole_steps[2][0]
    assert first["num_cached_tokens"] == 0 and again["num_cached_tokens"] == BLOCK
    check(reference, cases(images)["one"], again)


def test_other_image_of_the_same_size_misses(whole_steps, reference, images):
    other = whole_steps[3][0]
    assert other["prompt_token_ids"] == whole_steps[0][0]["prompt_token_ids"]  # same size: same block
    assert other["num_cached_tokens"] == 0
    check(reference, (cases(images)["one"][0], [images["a2"]]), other)


def test_hit_that_would_end_inside_an_image_stops_before_it(whole_steps, reference, images):
    case = cases(images)["hit_split"]
    first, again = whole_steps[4][0], whole_steps[5][0]
    expanded = check(reference, case, first)
    (start, end), = expanded.blocks
    assert start < BLOCK <= end < len(expanded.ids) < 2 * BLOCK  # the longest hit would end inside the image
    assert again["num_cached_tokens"] == 0  # moved back to a block boundary before START: 0
    check(reference, case, again)


def test_chunked_prefill_keeps_images_whole(chunked, reference, images):
    c = cases(images)
    for name, ours in zip(("chunk_split", "chunks", "two"), chunked[0]):
        expanded = check(reference, c[name], ours)
        if name != "two":  # a 384-token step would end inside one of its images
            assert any(s < k * CHUNK <= e for s, e in expanded.blocks for k in (1, 2))


def test_dspark_drafting_beside_images(drafted, reference, ckpt, images):
    """Speculative decoding with images: greedy tokens and log-probs equal the non-speculative reference's;
    every step drafted, and the drafts equal those of a drafter written from the spec (tests/oracle/
    dspark_ref.py) fed the reference's features, also where its window holds image tokens."""
    from tests.oracle.dspark_ref import HFDSparkReference

    drafter = HFDSparkReference(ckpt, main=reference.model)
    c, steps = cases(images), -(-(MAX_TOKENS - 1) // (DRAFTS + 1))  # each request's 7 decoded tokens
    for name, ours in zip(DRAFTED, drafted["batches"][0]):
        expanded = check(reference, c[name], ours)
        tokens = ours["tokens"]
        assert not any(0 <= t - SENTINEL_BASE < 5 for t in tokens)  # (the reference's stages route no sentinel)
        seq, features = expanded.ids + tokens, reference.features(expanded, tokens, drafter.targets)
        rows = [(P, d) for prompt, P, d in drafted["draft_rows"] if list(prompt) == expanded.ids and P < len(seq)]
        assert len(rows) >= steps, rows
        for P, drafts in rows:
            want = drafter.draft(seq[:P], seq[P], DRAFTS, drafts=drafts, features=features)["logits"]  # [N, V]
            top2 = want.topk(2, dim=-1).values
            clear = (top2[:, 0] - top2[:, 1]) > 10 * LOGIT_TOL
            assert [d for k, d in enumerate(drafts) if clear[k]] == want.argmax(-1)[clear].tolist(), (name, P)
        if name == "image_last":
            assert min(P for P, _ in rows) - drafter.window <= expanded.blocks[-1][1]  # the window holds image tokens
    counters = drafted["spec_decode"]
    drafts = counters["vllm:spec_decode_num_drafts"]
    assert drafts >= len(DRAFTED) * steps, counters
    assert counters["vllm:spec_decode_num_draft_tokens"] == DRAFTS * drafts, counters


@pytest.mark.gpu
@pytest.mark.skipif(not os.environ.get("DSV4_FLASH_VISION_CKPT"), reason="needs DSV4_FLASH_VISION_CKPT (gpu_check.sh vision-flash)")
def test_flash_vision_serves_images(tmp_path, images):
    """Vision-Exp dimensions on the GPU (bf16, FP8 KV, CUDA graphs, FlashMLA, 64-query attention calls that
    cut image blocks): prompts with one and two images give the expanded prompt and finite log-probs; a
    resend hits the prefix cache. No reference at these dimensions (the CPU tests hold the model to one)."""
    ckpt = Path(os.environ["DSV4_FLASH_VISION_CKPT"])
    c = cases(images)
    batches = [[{"ids": c[n][0], "images": c[n][1]} for n in ("one", "two", "chunks")],
               [{"ids": c["one"][0], "images": c["one"][1]}]]
    engine = dict(dtype="bfloat16", kv_cache_dtype="fp8", enforce_eager=False, enable_prefix_caching=True,
                  max_model_len=4096, max_num_batched_tokens=4096, gpu_memory_utilization=0.8)
    out = run(tmp_path, ckpt, engine, batches, "flash_vision", env={"VLLM_DSV4_ATTN_QUERY_CHUNK": "64"})["batches"]
    from tests.vision.reference import place_image
    from vllm_dsv4.config import VisionConfig

    vision = VisionConfig.from_dict(json.loads((ckpt / "config.json").read_text()))
    for name, ours in zip(("one", "two", "chunks"), out[0]):
        ids, files = c[name]
        files, want = iter(files), []
        for token in ids:
            want += [token] if token != PLACEHOLDER_ID else (
                129257 + place_image(Image.open(next(files)), vision, len(want))[3]).tolist()
        assert ours["prompt_token_ids"] == want
        assert torch.isfinite(ours["logprobs"].max(-1).values).all()
    assert out[1][0]["num_cached_tokens"] == BLOCK and out[1][0]["tokens"] == out[0][0]["tokens"]
