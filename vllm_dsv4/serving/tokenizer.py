"""Tokenizer modes ``dsv4_plugin`` (the release told from the checkpoint), ``dsv4_preview`` and
``dsv4_0731``: the checkpoint's HF tokenizer with ``apply_chat_template`` replaced by the release's
Python encoder (``encoding.py``), as vLLM's own ``deepseek_v4`` mode does with its copy.

Token ids come from the encoder's pieces (``encoding.Prompt``): a special-token string in markup is its
token; everything else, markup's plain text and message text alike, is encoded by the tokenizer without
its added tokens, so a message spelling ``<｜Assistant｜>`` or ``</think>`` gets ordinary tokens. Plain
runs are cut only where markup has a special token, where the tokenizer itself cuts, so an honest
conversation's ids equal those of its prompt string encoded whole.

vLLM looks the renderer up under the same mode names; ours (``renderer.py``) always asks for token ids.
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any

from vllm_dsv4 import get_logger
from vllm_dsv4.serving.encoding import PREVIEW, R0731, RELEASES, Prompt, Release, render_request

ENCODER_FILE = "encoding/encoding_dsv4.py"  # the release's encoder in its HF repository
CONFIG_FILE = "config.json"


def release_of(config: dict | None, encoder_source: str | None, where: str) -> tuple[Release, str]:
    """``(release, why)`` of a checkpoint from its ``config.json`` and its encoder's source text (read as
    text, never run): the encoder's effort paragraphs when it ships one, else the DSpark draft keys
    (``dspark_*``: 0731, Pro-0813, Vision-Exp) against the April checkpoints without them."""
    if encoder_source is not None:
        if "Beyond maximum" in encoder_source:
            return R0731, f"{ENCODER_FILE} has the 0731 effort table"
        if "Absolute maximum" in encoder_source:
            return PREVIEW, f"{ENCODER_FILE} has the preview effort table"
    if config is not None:
        if "dspark_block_size" in config:
            return R0731, f"{CONFIG_FILE} has dspark_* keys (a DSpark-era release)"
        return PREVIEW, f"{CONFIG_FILE} has no dspark_* keys (an April release)"
    raise ValueError(f"cannot tell the DeepSeek-V4 release of {where}: it has neither {CONFIG_FILE} nor "
                     f"{ENCODER_FILE}; choose the chat encoding with --tokenizer-mode dsv4_preview or dsv4_0731")


def _read_text(path_or_repo: str, filename: str, kwargs: dict) -> str | None:
    from transformers.utils import cached_file

    path = cached_file(path_or_repo, filename, revision=kwargs.get("revision"), cache_dir=kwargs.get("cache_dir"),
                       _raise_exceptions_for_missing_entries=False, _raise_exceptions_for_connection_errors=False)
    if path is None:
        return None
    with open(path, encoding="utf-8") as f:
        return f.read()


def detect_release(path_or_repo: str, kwargs: dict) -> Release:
    """The release of the checkpoint at ``path_or_repo`` (a directory or a hub id); logged with why."""
    config_text = _read_text(path_or_repo, CONFIG_FILE, kwargs)
    try:
        config = json.loads(config_text) if config_text is not None else None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path_or_repo}: {CONFIG_FILE} is not JSON ({e})") from None
    release, why = release_of(config, _read_text(path_or_repo, ENCODER_FILE, kwargs), path_or_repo)
    get_logger(__name__).info("vllm-dsv4: %s chat encoding for %s (%s)", release.name, path_or_repo, why)
    return release


class TokenIds:
    """Token ids of a ``Prompt``: markup's special-token strings through the tokenizer's added vocabulary,
    every plain run through ``plain`` (the tokenizer without added tokens), in one batch."""

    def __init__(self, backend, added_vocab: dict[str, int]):
        from tokenizers import Tokenizer

        spec = json.loads(backend.to_str())
        spec["added_tokens"], spec["post_processor"] = [], None
        self.plain = Tokenizer.from_str(json.dumps(spec))
        self.added = dict(added_vocab)
        # Leftmost, then longest, as the tokenizer matches added tokens.
        self.marker = re.compile("|".join(re.escape(t) for t in sorted(self.added, key=len, reverse=True)))
        spelled = [t for t, e in zip(self.added, self.plain.encode_batch(list(self.added), add_special_tokens=False))
                   if set(e.ids) & set(self.added.values())]
        if spelled:
            raise ValueError(f"the tokenizer encodes {spelled[:3]} as plain text to added-token ids: message text "
                             f"could not be kept apart from markup")

    def __call__(self, prompt: Prompt) -> list[int]:
        runs: list[list[str]] = [[]]  # plain text between consecutive special tokens
        specials: list[int] = []
        for string, is_markup in prompt.pieces:
            if not is_markup:
                runs[-1].append(string)
                continue
            start = 0
            for match in self.marker.finditer(string):
                runs[-1].append(string[start:match.start()])
                specials.append(self.added[match.group()])
                runs.append([])
                start = match.end()
            runs[-1].append(string[start:])
        encoded = self.plain.encode_batch(["".join(run) for run in runs], add_special_tokens=False)
        ids = list(encoded[0].ids)
        for special, run in zip(specials, encoded[1:]):
            ids.append(special)
            ids.extend(run.ids)
        return ids


def wrap(tokenizer, release: Release):
    """A copy of ``tokenizer`` (an HF fast tokenizer) whose chat template is ``release``'s encoder."""
    added_vocab = tokenizer.get_added_vocab()
    token_ids = TokenIds(tokenizer.backend_tokenizer, added_vocab)

    class Dsv4ChatTokenizer(tokenizer.__class__):  # type: ignore[misc, valid-type]
        def apply_chat_template(self, messages, tools: list[dict[str, Any]] | None = None, **kwargs):
            # vLLM passes the parsed conversation as ``conversation`` and the raw request as ``messages``.
            prompt = render_request(list(kwargs.pop("conversation", messages)), tools, release=release, **kwargs)
            if not kwargs.get("tokenize", True):
                return str(prompt)
            ids = token_ids(prompt)
            if kwargs.get("truncation") and kwargs.get("max_length") is not None:
                keep = kwargs["max_length"]
                ids = ids[-keep:] if self.truncation_side == "left" and keep else ids[:keep]
            return ids

        def num_special_tokens_to_add(self) -> int:
            return len(self.encode(""))

        def get_added_vocab(self) -> dict[str, int]:
            return dict(added_vocab)

        def __reduce__(self):
            return wrap, (tokenizer, release)

    Dsv4ChatTokenizer.__name__ = f"Dsv4{tokenizer.__class__.__name__}"
    wrapped = copy.copy(tokenizer)
    wrapped.__class__ = Dsv4ChatTokenizer
    return wrapped


class Dsv4Tokenizer:
    """``TokenizerRegistry`` entry: ``from_pretrained`` returns the wrapped, cached HF tokenizer, with the
    release's encoding (``release`` None: told from the checkpoint)."""

    release: str | None = None

    @classmethod
    def from_pretrained(cls, path_or_repo, *args, **kwargs):
        from transformers import TokenizersBackend
        from vllm.tokenizers.hf import get_cached_tokenizer

        release = RELEASES[cls.release] if cls.release else detect_release(str(path_or_repo), kwargs)
        return get_cached_tokenizer(wrap(TokenizersBackend.from_pretrained(path_or_repo, *args, **kwargs), release))


class Dsv4PreviewTokenizer(Dsv4Tokenizer):
    release = PREVIEW.name


class Dsv4Tokenizer0731(Dsv4Tokenizer):
    release = R0731.name
