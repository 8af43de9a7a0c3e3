"""Renderer of our tokenizer modes: vLLM's ``DeepseekV4Renderer``, always taking token ids, and keying
images by their content.

vLLM's chat endpoint asks ``apply_chat_template`` for the prompt string (``tokenize=False``, and a
request's ``chat_template_kwargs`` may say so too) and then encodes that string, every special-token
string in the messages' text included: a forged turn. Here the renderer asks for the token ids, which
keep message text ordinary text (``tokenizer.TokenIds``).

A media part may carry a ``uuid``, and vLLM then keys its processor, encoder and prefix caches by that id
instead of the content, or takes the id alone for the cached item: one client could send its image under
another's id, or get another's image by its id. The ids are dropped here, so the caches key by content.
"""

from __future__ import annotations

from vllm.renderers.deepseek_v4 import DeepseekV4Renderer


class Dsv4Renderer(DeepseekV4Renderer):
    def _apply_chat_template(self, *args, **kwargs):
        return super()._apply_chat_template(*args, **{**kwargs, "tokenize": True})

    def render_messages(self, *args, **kwargs):
        conversation, prompt = super().render_messages(*args, **kwargs)
        return conversation, keyed_by_content(prompt)

    async def render_messages_async(self, *args, **kwargs):
        conversation, prompt = await super().render_messages_async(*args, **kwargs)
        return conversation, keyed_by_content(prompt)


def keyed_by_content(prompt: dict) -> dict:
    """``prompt`` without the client's media ids; a media part without its data is refused."""
    prompt.pop("multi_modal_uuids", None)
    for modality, items in (prompt.get("multi_modal_data") or {}).items():
        if items is None or any(item is None for item in (items if isinstance(items, list) else [items])):
            raise ValueError(f"each {modality} part must carry its {modality} (a URL or data URI); a part "
                             f"naming a cached {modality} by its uuid alone is not taken")
    return prompt
