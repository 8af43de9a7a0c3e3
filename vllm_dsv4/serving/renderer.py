"""Renderer of our tokenizer modes: vLLM's ``DeepseekV4Renderer``, always taking token ids.

vLLM's chat endpoint asks ``apply_chat_template`` for the prompt string (``tokenize=False``, and a
request's ``chat_template_kwargs`` may say so too) and then encodes that string, every special-token
string in the messages' text included: a forged turn. Here the renderer asks for the token ids, which
keep message text ordinary text (``tokenizer.TokenIds``).
"""

from __future__ import annotations

from vllm.renderers.deepseek_v4 import DeepseekV4Renderer


class Dsv4Renderer(DeepseekV4Renderer):
    def _apply_chat_template(self, *args, **kwargs):
        return super()._apply_chat_template(*args, **{**kwargs, "tokenize": True})
