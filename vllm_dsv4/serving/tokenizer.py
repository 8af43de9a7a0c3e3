"""Tokenizer mode ``dsv4_plugin``: the checkpoint's HF tokenizer with ``apply_chat_template`` replaced by
the release's Python encoder (``encoding.py``), as vLLM's own ``deepseek_v4`` mode does with its copy.

vLLM looks the renderer up under the same mode name; ours is vLLM's ``DeepseekV4Renderer``, which only
forwards to this tokenizer's ``apply_chat_template`` (``serving/__init__.py`` registers both).
"""

from __future__ import annotations

import copy
from typing import Any

from vllm_dsv4.serving.encoding import encode_request


def wrap(tokenizer):
    """A copy of ``tokenizer`` (an HF fast tokenizer) whose chat template is the DeepSeek-V4 encoder."""
    added_vocab = tokenizer.get_added_vocab()

    class Dsv4ChatTokenizer(tokenizer.__class__):  # type: ignore[misc, valid-type]
        def apply_chat_template(self, messages, tools: list[dict[str, Any]] | None = None, **kwargs):
            # vLLM passes the parsed conversation as ``conversation`` and the raw request as ``messages``.
            prompt = encode_request(list(kwargs.pop("conversation", messages)), tools, **kwargs)
            if not kwargs.get("tokenize", True):
                return prompt
            limits = {k: kwargs[k] for k in ("truncation", "max_length") if k in kwargs}
            return self.encode(prompt, add_special_tokens=False, **limits)

        def num_special_tokens_to_add(self) -> int:
            return len(self.encode(""))

        def get_added_vocab(self) -> dict[str, int]:
            return dict(added_vocab)

        def __reduce__(self):
            return wrap, (tokenizer,)

    Dsv4ChatTokenizer.__name__ = f"Dsv4{tokenizer.__class__.__name__}"
    wrapped = copy.copy(tokenizer)
    wrapped.__class__ = Dsv4ChatTokenizer
    return wrapped


class Dsv4Tokenizer:
    """``TokenizerRegistry`` entry: ``from_pretrained`` returns the wrapped, cached HF tokenizer."""

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        from transformers import TokenizersBackend
        from vllm.tokenizers.hf import get_cached_tokenizer

        return get_cached_tokenizer(wrap(TokenizersBackend.from_pretrained(*args, **kwargs)))
