"""Images through vLLM's OpenAI server (``tiny-vision``): chat ``image_url`` parts as data URIs and as
files under ``--allowed-local-media-path``, several per message and per conversation, streamed through
the openai client; bad images answered 400 naming the problem while the server goes on serving."""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest
from PIL import Image

from tests.serving.conftest import ENGINE_FLAGS, vllm_server
from vllm_dsv4.vision import layout

pytestmark = pytest.mark.e2e

LIMIT = 2  # --limit-mm-per-prompt


def png(width: int, height: int, seed: int = 0, noise: bool = True) -> bytes:
    pixels = (np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8) if noise
              else np.full((height, width, 3), 90, dtype=np.uint8))
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG", compress_level=0 if noise else 6)
    return buffer.getvalue()


def bomb() -> bytes:
    """A PNG of 20,000 x 10,000 one-bit pixels: 24 kB, over vLLM's default VLLM_MAX_IMAGE_PIXELS."""
    buffer = io.BytesIO()
    Image.new("1", (20000, 10000)).save(buffer, format="PNG")
    return buffer.getvalue()


def data_uri(data: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(data).decode()}}


def chat(*parts, turns: tuple = ()) -> dict:
    return {"model": "tiny", "max_tokens": 4, "temperature": 0,
            "messages": [*turns, {"role": "user", "content": [*parts]}]}


TEXT = {"type": "text", "text": "What is in this picture?"}


@pytest.fixture(scope="module")
def server(tmp_path_factory, make_checkpoint_module):
    work = tmp_path_factory.mktemp("vision_server")
    ckpt = make_checkpoint_module.make_checkpoint(work / "ckpt", "tiny-vision", quantized=False, seed=0)
    media = work / "media"
    media.mkdir()
    (media / "cat.png").write_bytes(png(300, 200, seed=1))
    (media / "big.png").write_bytes(png(4200, 4200, seed=2))  # 50 MiB, valid
    args = ["-m", "vllm.entrypoints.openai.api_server", "--model", str(ckpt), *ENGINE_FLAGS,
            "--tokenizer-mode", "dsv4_plugin", "--limit-mm-per-prompt", f'{{"image": {LIMIT}}}',
            "--allowed-local-media-path", str(media)]
    with vllm_server(args, work, {"VLLM_PLUGINS": "vllm_dsv4"}) as (base, log):
        yield base, media, ckpt


def post(base: str, body: dict) -> httpx.Response:
    return httpx.post(base + "/v1/chat/completions", json=body, timeout=300)


def prompt_tokens(ckpt, messages: list[dict], sizes: list[tuple[int, int]]) -> int:
    """The prompt's length as the engine must see it: the messages as the checkpoint's tokenizer encodes
    them (its release's defaults, as the server renders them), each placeholder its block and pad."""
    import json

    from vllm_dsv4.config import VisionConfig
    from vllm_dsv4.serving.tokenizer import Dsv4Tokenizer

    tokenizer = Dsv4Tokenizer.from_pretrained(str(ckpt))
    vision = VisionConfig.from_dict(json.loads((ckpt / "config.json").read_text()))
    ids, sizes = tokenizer.apply_chat_template(messages, tokenize=True), iter(sizes)
    placeholder = tokenizer.convert_tokens_to_ids(layout.IMAGE_PLACEHOLDER)
    length = 0
    for token in ids:
        if token == placeholder:
            length += layout.alignment_pad(length) + layout.solve_grid(*next(sizes), vision).num_block_tokens
        else:
            length += 1
    assert next(sizes, None) is None, "fewer placeholders than images"
    return length


def test_images_by_data_uri_and_file(server):
    base, media, ckpt = server
    cat = {"type": "image_url", "image_url": {"url": f"file://{media}/cat.png"}}
    earlier = [{"role": "user", "content": [data_uri(png(224, 224, seed=3))]}, {"role": "assistant", "content": "A."}]
    body = chat(TEXT, cat, turns=earlier)  # two images: one per turn
    r = post(base, body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == prompt_tokens(ckpt, body["messages"], [(224, 224), (300, 200)])
    two = chat(TEXT, data_uri(png(500, 130, seed=4)), data_uri(png(90, 300, seed=5)))  # two in one message
    r = post(base, two)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == prompt_tokens(ckpt, two["messages"], [(500, 130), (90, 300)])


BAD = {
    "not an image": (lambda media: data_uri(b"this is not a picture"), "Failed to load image"),
    "truncated": (lambda media: data_uri(png(64, 64)[:2000]), "Failed to load image"),
    "1x1": (lambda media: data_uri(png(1, 1)), "image is 1x1 pixels; each side must be at least 14 pixels"),
    "100000x10": (lambda media: data_uri(png(100_000, 10, noise=False)), "image is 100000x10 pixels"),
    "200 M pixels": (lambda media: data_uri(bomb()), r"200000000 pixels\) exceeds limit"),  # in 24 kB
    "50 MB file": (lambda media: {"type": "image_url", "image_url": {"url": f"file://{media}/big.png"}},
                   r"image file is 50\.\d MiB; the limit is 20 MiB"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_image_is_a_400_naming_the_problem(server, case):
    base, media, _ = server
    part, message = BAD[case]
    r = post(base, chat(TEXT, part(media)))
    assert r.status_code == 400, r.text
    assert __import__("re").search(message, r.json()["error"]["message"]), r.json()
    ok = post(base, chat(TEXT, data_uri(png(40, 40, seed=9))))  # and the next request is served
    assert ok.status_code == 200, ok.text


def test_more_images_than_the_limit_is_a_400(server):
    base, _, _ = server
    r = post(base, chat(*[data_uri(png(32, 32, seed=s)) for s in range(LIMIT + 1)]))
    assert r.status_code == 400 and "image" in r.json()["error"]["message"], r.text
    assert post(base, chat(TEXT, data_uri(png(32, 32)))).status_code == 200


AUDIO = {"type": "input_audio", "input_audio": {"data": base64.b64encode(b"RIFF....WAVE").decode(), "format": "wav"}}
TOOL_TURNS = ({"role": "user", "content": "Look it up."},
              {"role": "assistant", "tool_calls": [{"id": "k", "type": "function",
                                                    "function": {"name": "f", "arguments": "{}"}}]})
MISPLACED = {
    "audio part": (chat(TEXT, AUDIO), "audio"),
    "image in a tool result": ({**chat(TEXT), "messages": [
        *TOOL_TURNS, {"role": "tool", "tool_call_id": "k", "content": [data_uri(png(32, 32))]}]}, "not in tool results"),
}


@pytest.mark.parametrize("case", list(MISPLACED))
def test_other_media_and_misplaced_images_are_400s(server, case):
    """A part of another medium, and an image where DeepSeek-V4 takes none, are refused before the engine."""
    base, _, _ = server
    body, message = MISPLACED[case]
    r = post(base, body)
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    assert post(base, chat(TEXT, data_uri(png(32, 32)))).status_code == 200


def test_client_media_ids_do_not_key_the_caches(server):
    """Two images of different sizes under one client ``uuid``: each prompt has its own image's block (vLLM
    would take the first image's cached block for the second); a ``uuid`` without an image is a 400."""
    base, _, ckpt = server
    for size, seed in (((224, 224), 21), ((90, 300), 22)):
        body = chat(TEXT, {**data_uri(png(*size, seed=seed)), "uuid": "shared-id"})
        r = post(base, body)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == prompt_tokens(ckpt, body["messages"], [size])
    r = post(base, chat(TEXT, {"type": "image_url", "image_url": None, "uuid": "shared-id"}))
    assert r.status_code == 400 and "uuid alone is not taken" in r.json()["error"]["message"], r.text


def test_streaming_chat_with_an_image(server):
    from openai import OpenAI

    base, _, _ = server
    client = OpenAI(base_url=base + "/v1", api_key="none")
    stream = client.chat.completions.create(model="tiny", max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            messages=[{"role": "user", "content": [TEXT, data_uri(png(224, 224))]}])
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 6 and chunks[-1].usage.prompt_tokens > 114
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
