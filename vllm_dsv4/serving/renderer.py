"""Renderer of our tokenizer modes: vLLM's ``DeepseekV4Renderer``, always taking token ids, keying images
by their content, and refusing what its message parsing cannot take.

- Token ids: vLLM's chat endpoint asks ``apply_chat_template`` for the prompt string (``tokenize=False``,
  and a request's ``chat_template_kwargs`` may say so too) and then encodes that string, every
  special-token string in the messages' text included: a forged turn. Here the renderer asks for the token
  ids, which keep message text ordinary text (``tokenizer.TokenIds``).
- Media ids: a media part may carry a ``uuid``, and vLLM then keys its processor, encoder and prefix caches
  by that id instead of the content, or takes the id alone for the cached item: one client could send its
  image under another's id, or get another's image by its id. The ids are dropped here, so the caches key
  by content.
- Deep arguments: tool-call arguments in the history nested deeper than ``dsml.MAX_JSON_DEPTH`` (vLLM
  parses them with Python's json, which recurses per level: a ``RecursionError``, a 500, before our
  encoding runs) get a 400 naming the message.
"""

from __future__ import annotations

from vllm.renderers.deepseek_v4 import DeepseekV4Renderer

from vllm_dsv4.serving.dsml import MAX_JSON_DEPTH, nesting_depth


class Dsv4Renderer(DeepseekV4Renderer):
    def _apply_chat_template(self, *args, **kwargs):
        return super()._apply_chat_template(*args, **{**kwargs, "tokenize": True})

    def render_messages(self, messages, *args, **kwargs):
        refuse_deep_arguments(messages)
        conversation, prompt = super().render_messages(messages, *args, **kwargs)
        return conversation, keyed_by_content(prompt)

    async def render_messages_async(self, messages, *args, **kwargs):
        refuse_deep_arguments(messages)
        conversation, prompt = await super().render_messages_async(messages, *args, **kwargs)
        return conversation, keyed_by_content(prompt)


def keyed_by_content(prompt: dict) -> dict:
    """``prompt`` without the client's media ids; a media part without its data is refused."""
    prompt.pop("multi_modal_uuids", None)
    for modality, items in (prompt.get("multi_modal_data") or {}).items():
        if items is None or any(item is None for item in (items if isinstance(items, list) else [items])):
            raise ValueError(f"each {modality} part must carry its {modality} (a URL or data URI); a part "
                             f"naming a cached {modality} by its uuid alone is not taken")
    return prompt


def refuse_deep_arguments(messages) -> None:
    """ValueError naming the first message whose tool-call arguments (JSON text) nest too deeply."""
    for i, message in enumerate(messages):
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        for call in calls if isinstance(calls, list) else ():
            function = call.get("function") if isinstance(call, dict) else None
            arguments = function.get("arguments") if isinstance(function, dict) else None
            if isinstance(arguments, str) and nesting_depth(arguments) > MAX_JSON_DEPTH:
                raise ValueError(f"messages[{i}]: tool call arguments nest deeper than {MAX_JSON_DEPTH} levels")
