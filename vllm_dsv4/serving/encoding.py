"""DeepSeek-V4 chat encoding: the rules of the releases' ``encoding/encoding_dsv4.py`` (docs/MODEL.md §10).

A conversation becomes one prompt::

    BOS [effort preamble] system [\\n\\n## Tools ...] <｜User｜>user <｜Assistant｜><think>|</think>
        [reasoning</think>] content [\\n\\n<｜DSML｜tool_calls>...</｜DSML｜tool_calls>] EOS <｜User｜>...

- There is no tool role: tool results are merged into the next user turn as ``<tool_result>`` blocks,
  sorted by the order of the calls in the preceding assistant turn.
- Thinking mode opens the answer with ``<think>``, chat mode with ``</think>``. Reasoning of assistant
  turns before the last user turn is dropped, unless any message carries tools.
- In thinking mode the first message is preceded by the reasoning-effort preamble of the release's
  table (``Release``): the April preview has one paragraph ("Absolute maximum", its ``max``), the 0731
  release two (``high`` = that paragraph, ``max`` = "Beyond maximum"). vLLM 0.32's copy of the encoder
  carries the 0731 table only.

The prompt is kept as ``Prompt`` pieces: *markup* the template writes (a special-token string there is
the special token) and *text* from the request's messages (user and tool-result text, assistant turns
sent back, tool-call arguments), which stays ordinary text whatever it spells, so that no message can
forge a turn, a tool call or its result. System and developer prompts and tool definitions are markup,
as in the release. ``tokenizer.py`` turns the pieces into token ids.

Only the request-facing pieces live here; no vLLM imports, so the rules can be tested on their own.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any, Mapping

from vllm_dsv4.config import IMAGE_PLACEHOLDER

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

ABSOLUTE_MAXIMUM = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
    "scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)
BEYOND_MAXIMUM = (
    "Reasoning Effort: Beyond maximum \u2014 exhaustive, relentless, and uncompromising.\n"
    "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: exhaustively "
    "decompose the problem into its most fundamental components, trace every causal chain to its root, and "
    "resolve the underlying cause rather than any surface symptom.\n"
    "Do not stop reasoning until you have independently verified the solution from multiple angles and are "
    "certain that no assumption remains unchecked and no error remains undiscovered.\n\n"
)


@dataclass(frozen=True)
class Release:
    """A release's reasoning-effort table: ``preambles`` (its level -> the text prepended in thinking
    mode), ``levels`` (OpenAI ``reasoning_effort`` -> its level; ``"none"`` is chat mode) and ``default``
    (the level of a thinking request that names none)."""

    name: str
    preambles: Mapping[str, str]
    levels: Mapping[str, str]
    default: str


# The April preview: two levels, DeepSeek's API mapping (low / medium -> high, xhigh -> max).
PREVIEW = Release(
    "preview", {"high": "", "max": ABSOLUTE_MAXIMUM},
    {"minimal": "high", "low": "high", "medium": "high", "high": "high", "xhigh": "max", "max": "max"}, "high")
# 0731 (and the releases after it): three levels, vLLM 0.32's request mapping for them.
R0731 = Release(
    "0731", {"low": "", "high": ABSOLUTE_MAXIMUM, "max": BEYOND_MAXIMUM},
    {"minimal": "low", "low": "low", "medium": "low", "high": "high", "xhigh": "high", "max": "max"}, "high")
RELEASES = {r.name: r for r in (PREVIEW, R0731)}

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


class Prompt:
    """A prompt as ``pieces``: ``(string, is_markup)``. Markup is the template's own text (special-token
    strings in it are special tokens); the rest is message text, always ordinary text."""

    def __init__(self) -> None:
        self.pieces: list[tuple[str, bool]] = []

    def markup(self, string: str) -> None:
        if string:
            self.pieces.append((string, True))

    def text(self, string: str) -> None:
        if string:
            self.pieces.append((string, False))

    def __str__(self) -> str:
        return "".join(string for string, _ in self.pieces)


def to_json(value: Any) -> str:
    """JSON as the release writes it (``ensure_ascii=False``, default separators)."""
    return json.dumps(value, ensure_ascii=False)


def render_tools(tools: list[dict]) -> str:
    """The "## Tools" section: one JSON schema (the OpenAI ``function`` object) per line."""
    schemas = "\n".join(to_json(t["function"] if "function" in t else t) for t in tools)
    return TOOLS_TEMPLATE.format(dsml=DSML, think_start=THINK_START, think_end=THINK_END, schemas=schemas)


IMAGE_PARTS = ("image_url", "image")  # OpenAI's part, and what vLLM's chat parser turns it into


def content_parts(content: Any) -> list[tuple[str, str]]:
    """A message's content as ``(kind, text)`` parts: ``("text", ...)``, or ``("image", "")`` for an image
    part (its pixels travel beside the prompt, matched to placeholders by order)."""
    if content is None:
        return []
    if isinstance(content, str):
        return [("text", content)]
    if not isinstance(content, list):
        raise EncodingError(f"message content must be a string or a list of parts, got {type(content).__name__}")
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if isinstance(part, str):
            parts.append(("text", part))
        elif kind == "text":
            parts.append(("text", part.get("text") or ""))
        elif kind in IMAGE_PARTS:
            parts.append(("image", ""))
        else:
            raise EncodingError(f"DeepSeek-V4 takes text and images; unsupported content part {kind!r}")
    return parts


def text_of(content: Any) -> str:
    """Plain text of a message's content (not a user turn's: images are refused), parts joined by a blank line."""
    parts = content_parts(content)
    if any(kind == "image" for kind, _ in parts):
        raise EncodingError("DeepSeek-V4 takes images in user turns only (not in tool results or other roles)")
    return "\n\n".join(text for _, text in parts)


def write_content(prompt: Prompt, content: Any) -> None:
    """A user turn's content: text parts as message text, each image part the image placeholder as markup
    (typed into text, the placeholder stays text), parts joined by a blank line."""
    for i, (kind, text) in enumerate(content_parts(content)):
        prompt.text("\n\n" if i else "")
        if kind == "image":
            prompt.markup(IMAGE_PLACEHOLDER)
        else:
            prompt.text(text)


def parse_arguments(arguments: Any) -> dict:
    """A history tool call's arguments as an object (the release keeps unparsable ones as one string)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            arguments = {"arguments": arguments}
    if not isinstance(arguments, dict):
        raise EncodingError(f"tool call arguments must be a JSON object, got {to_json(arguments)[:80]}")
    return arguments


def render_tool_calls(prompt: Prompt, tool_calls: list[dict]) -> None:
    """``\\n\\n<｜DSML｜tool_calls>`` block of an assistant turn (OpenAI ``tool_calls`` in); names and
    arguments are message text, strings raw and everything else JSON."""
    prompt.markup(f"\n\n<{DSML}tool_calls>\n")
    for i, call in enumerate(tool_calls):
        fn = call.get("function") or {}
        if not fn.get("name"):
            raise EncodingError("assistant tool call without a function name")
        prompt.markup(("\n" if i else "") + f'<{DSML}invoke name="')
        prompt.text(str(fn["name"]))
        prompt.markup('">\n')
        for j, (key, value) in enumerate(parse_arguments(fn.get("arguments", {})).items()):
            prompt.markup(("\n" if j else "") + f'<{DSML}parameter name="')
            prompt.text(str(key))
            prompt.markup(f'" string="{"true" if isinstance(value, str) else "false"}">')
            prompt.text(value if isinstance(value, str) else to_json(value))
            prompt.markup(f"</{DSML}parameter>")
        prompt.markup(f"\n</{DSML}invoke>")
    prompt.markup(f"\n</{DSML}tool_calls>")


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
            block = {"type": "text", "content": msg.get("content")}
            if open_user and prev.get("task") is None:
                prev["content_blocks"].append(block)
            else:
                new = {"role": "user", "content": msg.get("content"), "content_blocks": [block]}
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


def render_user(prompt: Prompt, msg: dict) -> None:
    """``<｜User｜>`` and the turn's text and ``<tool_result>`` blocks, joined by blank lines."""
    prompt.markup(USER)
    blocks = msg.get("content_blocks")
    if not blocks:
        write_content(prompt, msg.get("content"))
        return
    for i, block in enumerate(blocks):
        prompt.markup("\n\n" if i else "")
        if block["type"] == "text":
            write_content(prompt, block["content"])
        else:
            prompt.markup("<tool_result>")
            prompt.text(text_of(block.get("content")))
            prompt.markup("</tool_result>")


def render_message(prompt: Prompt, i: int, messages: list[dict], last_user: int, thinking: bool, drop: bool,
                   preamble: str) -> None:
    """One message plus, after a user/developer turn, the assistant opener (``render_message``);
    ``last_user`` is ``last_user_index(messages)``, worked out once per conversation."""
    msg = messages[i]
    role = msg.get("role")
    prompt.markup(preamble if i == 0 and thinking else "")
    extras = ""
    if msg.get("tools"):
        extras += "\n\n" + render_tools(msg["tools"])
    if msg.get("response_format"):
        extras += "\n\n" + RESPONSE_FORMAT_TEMPLATE.format(schema=to_json(msg["response_format"]))
    if role == "system":
        prompt.markup(text_of(msg.get("content")) + extras)
    elif role == "developer":
        if not text_of(msg.get("content")):
            raise EncodingError("a developer message needs content")
        prompt.markup(USER + text_of(msg.get("content")) + extras)
    elif role == "user":
        render_user(prompt, msg)
    elif role == "latest_reminder":
        prompt.markup(LATEST_REMINDER)
        prompt.text(text_of(msg.get("content")))
    elif role == "assistant":
        prev_task = i > 0 and messages[i - 1].get("task") is not None
        if thinking and not prev_task and (not drop or i > last_user):
            prompt.text(msg.get("reasoning_content") or msg.get("reasoning") or "")
            prompt.markup(THINK_END)
        prompt.text(text_of(msg.get("content")))
        if msg.get("tool_calls"):
            render_tool_calls(prompt, msg["tool_calls"])
        prompt.markup("" if msg.get("wo_eos") else EOS)
    else:
        raise EncodingError(f"DeepSeek-V4 has no {role!r} role")

    if i + 1 < len(messages) and messages[i + 1].get("role") not in ("assistant", "latest_reminder"):
        return
    task = msg.get("task")
    if task is not None:
        if task not in TASK_TOKENS:
            raise EncodingError(f"unknown task {task!r}; one of {sorted(TASK_TOKENS)}")
        opener = "" if task != "action" else ASSISTANT + (THINK_START if thinking else THINK_END)
        prompt.markup(opener + TASK_TOKENS[task])
    elif role in ("user", "developer"):
        opens_thinking = thinking and (not drop or i >= last_user)
        prompt.markup(ASSISTANT + (THINK_START if opens_thinking else THINK_END))


def encode_messages(
    messages: list[dict],
    *,
    thinking: bool,
    reasoning_effort: str | None = None,
    release: Release = PREVIEW,
    drop_thinking_history: bool = True,
    add_bos: bool = True,
) -> Prompt:
    """The prompt of a conversation (OpenAI-style messages; ``tools`` on a system/developer message).

    ``reasoning_effort`` is one of the release's levels (``release.preambles``), None for its default.
    """
    if not messages:
        raise EncodingError("messages must not be empty")
    level = release.default if reasoning_effort is None else reasoning_effort
    if level not in release.preambles:
        raise EncodingError(f"reasoning_effort must be one of the {release.name} release's levels "
                            f"{sorted(release.preambles)} or None, got {reasoning_effort!r}")
    for msg in messages:
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise EncodingError(f"every message needs a role: {str(msg)[:80]}")
    messages = sort_tool_results(merge_tool_messages(messages))
    drop = drop_thinking_history and not any(m.get("tools") for m in messages)
    if thinking and drop:
        messages = drop_thinking(messages)
    prompt = Prompt()
    prompt.markup(BOS if add_bos else "")
    last_user = last_user_index(messages)
    for i in range(len(messages)):
        render_message(prompt, i, messages, last_user, thinking, drop, release.preambles[level])
    try:
        str(prompt).encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate ("\\ud800" in the request JSON)
        raise EncodingError(f"messages contain invalid Unicode (unpaired surrogate {e.object[e.start]!r})") from None
    return prompt


def chat_options(kwargs: dict, release: Release = PREVIEW) -> tuple[bool, str | None]:
    """``(thinking, release level)`` from vLLM's chat-template kwargs.

    Thinking is on unless ``thinking``/``enable_thinking`` is given and false, or ``reasoning_effort`` is
    ``"none"``: the same rule as vLLM's ``deepseek_v4`` reasoning parser, which must agree with the prompt.
    """
    thinking = bool(kwargs.get("thinking") or kwargs.get("enable_thinking"))
    if "thinking" not in kwargs and "enable_thinking" not in kwargs:
        thinking = True
    effort = kwargs.get("reasoning_effort")
    if effort is None or effort == "none":
        return thinking and effort != "none", None
    if not isinstance(effort, str) or effort not in release.levels:
        raise EncodingError(f"reasoning_effort must be one of none, {', '.join(release.levels)}; got {effort!r}")
    return thinking, release.levels[effort]


def render_request(messages: list[dict], tools: list[dict] | None = None, *, release: Release = PREVIEW,
                   **kwargs) -> Prompt:
    """What the tokenizer's ``apply_chat_template`` renders: request tools go on the first system message
    (one is inserted at the front when there is none); ``continue_final_message`` leaves a final
    assistant turn open (no EOS)."""
    thinking, effort = chat_options(kwargs, release)
    messages = list(messages)
    if tools:
        at = next((i for i, m in enumerate(messages) if m.get("role") == "system"), None)
        if at is None:
            messages.insert(0, {"role": "system"})
            at = 0
        messages[at] = {**messages[at], "tools": tools}
    if kwargs.get("continue_final_message") and messages and messages[-1].get("role") == "assistant":
        messages[-1] = {**messages[-1], "wo_eos": True}
    return encode_messages(messages, thinking=thinking, reasoning_effort=effort, release=release,
                           drop_thinking_history=kwargs.get("drop_thinking", True))


def encode_request(messages: list[dict], tools: list[dict] | None = None, **kwargs) -> str:
    """``render_request`` as one string (the form ``apply_chat_template(tokenize=False)`` returns)."""
    return str(render_request(messages, tools, **kwargs))
