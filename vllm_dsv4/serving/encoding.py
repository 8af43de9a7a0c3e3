"""DeepSeek-V4 chat encoding: the rules of the release's ``encoding/encoding_dsv4.py`` (docs/MODEL.md §10).

A conversation becomes one prompt string::

    BOS [effort preamble] system [\\n\\n## Tools ...] <｜User｜>user <｜Assistant｜><think>|</think>
        [reasoning</think>] content [\\n\\n<｜DSML｜tool_calls>...</｜DSML｜tool_calls>] EOS <｜User｜>...

- There is no tool role: tool results are merged into the next user turn as ``<tool_result>`` blocks,
  sorted by the order of the calls in the preceding assistant turn.
- Thinking mode opens the answer with ``<think>``, chat mode with ``</think>``. Reasoning of assistant
  turns before the last user turn is dropped, unless any message carries tools.
- ``reasoning_effort="max"`` (thinking mode only) prepends a fixed paragraph; ``"high"``/``None`` add
  nothing. vLLM 0.32's copy of the encoder carries the later 0731 checkpoint's three-level table
  instead (``high`` = this release's ``max`` text), which is why the plugin ships its own.

Only the request-facing pieces live here; no vLLM imports, so the rules can be tested on their own.
"""

from __future__ import annotations

import copy
import json
from typing import Any

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
THINK_START, THINK_END = "<think>", "</think>"
DSML = "｜DSML｜"
USER, ASSISTANT, LATEST_REMINDER = "<｜User｜>", "<｜Assistant｜>", "<｜latest_reminder｜>"
TASK_TOKENS = {
    "action": "<｜action｜>",
    "query": "<｜query｜>",
    "authority": "<｜authority｜>",
    "domain": "<｜domain｜>",
    "title": "<｜title｜>",
    "read_url": "<｜read_url｜>",
}

REASONING_EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
    "scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)

# OpenAI-style request values -> the release's levels (DeepSeek's API maps low/medium to high, xhigh to max).
# "none" switches thinking off; anything else is a 400.
EFFORT_LEVELS = {"minimal": "high", "low": "high", "medium": "high", "high": "high", "xhigh": "max", "max": "max"}

TOOLS_TEMPLATE = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a \
"<{dsml}tool_calls>" block like the following:

<{dsml}tool_calls>
<{dsml}invoke name="$TOOL_NAME">
<{dsml}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{dsml}parameter>
...
</{dsml}invoke>
<{dsml}invoke name="$TOOL_NAME2">
...
</{dsml}invoke>
</{dsml}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, \
arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {think_start}), you MUST output your complete reasoning inside \
{think_start}...{think_end} BEFORE any tool calls or final response.

Otherwise, output directly after {think_end} with tool calls or final response.

### Available Tool Schemas

{schemas}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""
RESPONSE_FORMAT_TEMPLATE = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n{schema}"


class EncodingError(ValueError):
    """A conversation the DeepSeek-V4 format cannot express (vLLM answers 400 for ValueError)."""


def to_json(value: Any) -> str:
    """JSON as the release writes it (``ensure_ascii=False``, default separators)."""
    return json.dumps(value, ensure_ascii=False)


def render_tools(tools: list[dict]) -> str:
    """The "## Tools" section: one JSON schema (the OpenAI ``function`` object) per line."""
    schemas = "\n".join(to_json(t["function"] if "function" in t else t) for t in tools)
    return TOOLS_TEMPLATE.format(dsml=DSML, think_start=THINK_START, think_end=THINK_END, schemas=schemas)


def text_of(content: Any) -> str:
    """Plain text of a message's content: a string, or OpenAI text parts joined by a blank line."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise EncodingError(f"message content must be a string or a list of text parts, got {type(content).__name__}")
    parts = []
    for part in content:
        if isinstance(part, str):
            parts.append(part)
        elif isinstance(part, dict) and part.get("type") == "text":
            parts.append(part.get("text") or "")
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise EncodingError(f"DeepSeek-V4 takes text only; unsupported content part {kind!r}")
    return "\n\n".join(parts)


def encode_arguments(arguments: Any) -> str:
    """A history tool call's arguments as DSML parameter lines (strings raw, everything else JSON)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:  # the release keeps unparsable arguments as one string parameter
            arguments = {"arguments": arguments}
    if not isinstance(arguments, dict):
        raise EncodingError(f"tool call arguments must be a JSON object, got {to_json(arguments)[:80]}")
    return "\n".join(
        f'<{DSML}parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
        f"{v if isinstance(v, str) else to_json(v)}</{DSML}parameter>"
        for k, v in arguments.items()
    )


def render_tool_calls(tool_calls: list[dict]) -> str:
    """``\\n\\n<｜DSML｜tool_calls>`` block of an assistant turn (OpenAI ``tool_calls`` in)."""
    invokes = []
    for call in tool_calls:
        fn = call.get("function") or {}
        if not fn.get("name"):
            raise EncodingError("assistant tool call without a function name")
        invokes.append(
            f'<{DSML}invoke name="{fn["name"]}">\n{encode_arguments(fn.get("arguments", {}))}\n</{DSML}invoke>'
        )
    return f"\n\n<{DSML}tool_calls>\n" + "\n".join(invokes) + f"\n</{DSML}tool_calls>"


def merge_tool_messages(messages: list[dict]) -> list[dict]:
    """Tool results and user text become ``content_blocks`` of user turns (consecutive ones merge)."""
    merged: list[dict] = []
    for msg in messages:
        msg = copy.deepcopy(msg)
        role = msg.get("role")
        prev = merged[-1] if merged else None
        open_user = prev is not None and prev.get("role") == "user" and "content_blocks" in prev
        if role == "tool":
            block = {"type": "tool_result", "tool_use_id": msg.get("tool_call_id", ""), "content": msg.get("content")}
            if open_user:
                prev["content_blocks"].append(block)
            else:
                merged.append({"role": "user", "content_blocks": [block]})
        elif role == "user":
            block = {"type": "text", "text": text_of(msg.get("content"))}
            if open_user and prev.get("task") is None:
                prev["content_blocks"].append(block)
            else:
                new = {"role": "user", "content": block["text"], "content_blocks": [block]}
                new.update({k: msg[k] for k in ("task", "wo_eos") if k in msg})
                merged.append(new)
        else:
            merged.append(msg)
    return merged


def sort_tool_results(messages: list[dict]) -> list[dict]:
    """Order the tool results of each user turn as the preceding assistant turn ordered its calls."""
    order: dict[str, int] = {}
    for msg in messages:
        if msg.get("role") == "assistant" and msg.get("tool_calls"):
            order = {tc["id"]: i for i, tc in enumerate(msg["tool_calls"]) if tc.get("id")}
        elif msg.get("role") == "user" and msg.get("content_blocks") and order:
            blocks = msg["content_blocks"]
            results = iter(sorted((b for b in blocks if b["type"] == "tool_result"),
                                  key=lambda b: order.get(b.get("tool_use_id", ""), 0)))
            msg["content_blocks"] = [next(results) if b["type"] == "tool_result" else b for b in blocks]
    return messages


def drop_thinking(messages: list[dict]) -> list[dict]:
    """Before the last user turn: assistant reasoning removed, developer turns removed."""
    last_user = last_user_index(messages)
    out = []
    for i, msg in enumerate(messages):
        if msg.get("role") in ("user", "system", "tool", "latest_reminder") or i >= last_user:
            out.append(msg)
        elif msg.get("role") == "assistant":
            out.append({k: v for k, v in msg.items() if k not in ("reasoning", "reasoning_content")})
    return out


def last_user_index(messages: list[dict]) -> int:
    """Index of the last user or developer turn (-1 if none)."""
    return max((i for i, m in enumerate(messages) if m.get("role") in ("user", "developer")), default=-1)


def render_user(msg: dict) -> str:
    """``<｜User｜>`` and the turn's text and ``<tool_result>`` blocks, joined by blank lines."""
    blocks = msg.get("content_blocks")
    if not blocks:
        return USER + text_of(msg.get("content"))
    parts = [b["text"] if b["type"] == "text" else f"<tool_result>{text_of(b.get('content'))}</tool_result>"
             for b in blocks]
    return USER + "\n\n".join(parts)


def render_message(i: int, messages: list[dict], thinking: bool, drop: bool, effort: str | None) -> str:
    """One message plus, after a user/developer turn, the assistant opener (``render_message``)."""
    msg, last_user = messages[i], last_user_index(messages)
    role = msg.get("role")
    out = REASONING_EFFORT_MAX if (i == 0 and thinking and effort == "max") else ""
    extras = ""
    if msg.get("tools"):
        extras += "\n\n" + render_tools(msg["tools"])
    if msg.get("response_format"):
        extras += "\n\n" + RESPONSE_FORMAT_TEMPLATE.format(schema=to_json(msg["response_format"]))
    if role == "system":
        out += text_of(msg.get("content")) + extras
    elif role == "developer":
        if not text_of(msg.get("content")):
            raise EncodingError("a developer message needs content")
        out += USER + text_of(msg.get("content")) + extras
    elif role == "user":
        out += render_user(msg)
    elif role == "latest_reminder":
        out += LATEST_REMINDER + text_of(msg.get("content"))
    elif role == "assistant":
        reasoning = msg.get("reasoning_content") or msg.get("reasoning") or ""
        prev_task = i > 0 and messages[i - 1].get("task") is not None
        think = reasoning + THINK_END if thinking and not prev_task and (not drop or i > last_user) else ""
        calls = render_tool_calls(msg["tool_calls"]) if msg.get("tool_calls") else ""
        out += think + text_of(msg.get("content")) + calls + ("" if msg.get("wo_eos") else EOS)
    else:
        raise EncodingError(f"DeepSeek-V4 has no {role!r} role")

    if i + 1 < len(messages) and messages[i + 1].get("role") not in ("assistant", "latest_reminder"):
        return out
    task = msg.get("task")
    if task is not None:
        if task not in TASK_TOKENS:
            raise EncodingError(f"unknown task {task!r}; one of {sorted(TASK_TOKENS)}")
        if task != "action":
            return out + TASK_TOKENS[task]
        return out + ASSISTANT + (THINK_START if thinking else THINK_END) + TASK_TOKENS[task]
    if role in ("user", "developer"):
        opens_thinking = thinking and (not drop or i >= last_user)
        out += ASSISTANT + (THINK_START if opens_thinking else THINK_END)
    return out


def encode_messages(
    messages: list[dict],
    *,
    thinking: bool,
    reasoning_effort: str | None = None,
    drop_thinking_history: bool = True,
    add_bos: bool = True,
) -> str:
    """The prompt of a conversation (OpenAI-style messages; ``tools`` on a system/developer message).

    ``reasoning_effort`` is the release's level: ``None``, ``"high"`` or ``"max"``.
    """
    if not messages:
        raise EncodingError("messages must not be empty")
    if reasoning_effort not in (None, "high", "max"):
        raise EncodingError(f"reasoning_effort must be None, 'high' or 'max', got {reasoning_effort!r}")
    for msg in messages:
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise EncodingError(f"every message needs a role: {str(msg)[:80]}")
    messages = sort_tool_results(merge_tool_messages(messages))
    drop = drop_thinking_history and not any(m.get("tools") for m in messages)
    if thinking and drop:
        messages = drop_thinking(messages)
    prompt = (BOS if add_bos else "") + "".join(
        render_message(i, messages, thinking, drop, reasoning_effort) for i in range(len(messages)))
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate ("\\ud800" in the request JSON)
        raise EncodingError(f"messages contain invalid Unicode (unpaired surrogate {prompt[e.start]!r})") from None
    return prompt


def chat_options(kwargs: dict) -> tuple[bool, str | None]:
    """``(thinking, effort)`` from vLLM's chat-template kwargs.

    Thinking is on unless ``thinking``/``enable_thinking`` is given and false, or ``reasoning_effort`` is
    ``"none"``: the same rule as vLLM's ``deepseek_v4`` reasoning parser, which must agree with the prompt.
    """
    thinking = bool(kwargs.get("thinking") or kwargs.get("enable_thinking"))
    if "thinking" not in kwargs and "enable_thinking" not in kwargs:
        thinking = True
    effort = kwargs.get("reasoning_effort")
    if effort is None or effort == "none":
        return thinking and effort != "none", None
    if not isinstance(effort, str) or effort not in EFFORT_LEVELS:
        raise EncodingError(f"reasoning_effort must be one of none, {', '.join(EFFORT_LEVELS)}; got {effort!r}")
    return thinking, EFFORT_LEVELS[effort]


def encode_request(messages: list[dict], tools: list[dict] | None = None, **kwargs) -> str:
    """What the tokenizer's ``apply_chat_template`` renders: request tools go on the first system message
    (one is inserted at the front when there is none); ``continue_final_message`` leaves a final
    assistant turn open (no EOS)."""
    thinking, effort = chat_options(kwargs)
    messages = list(messages)
    if tools:
        at = next((i for i, m in enumerate(messages) if m.get("role") == "system"), None)
        if at is None:
            messages.insert(0, {"role": "system"})
            at = 0
        messages[at] = {**messages[at], "tools": tools}
    if kwargs.get("continue_final_message") and messages and messages[-1].get("role") == "assistant":
        messages[-1] = {**messages[-1], "wo_eos": True}
    return encode_messages(messages, thinking=thinking, reasoning_effort=effort,
                           drop_thinking_history=kwargs.get("drop_thinking", True))
