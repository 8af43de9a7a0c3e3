"""Tool parser ``dsv4_plugin``: DSML tool calls through ``dsml.DsmlParser``, plugged into vLLM 0.32's
engine-based parser protocol.

vLLM composes a reasoning parser and a tool parser per request (``DelegatingParser``). We keep vLLM's
``deepseek_v4`` reasoning parser, which splits ``<think>`` correctly, and replace the tool side, where
vLLM's ``deepseek_v4`` tool parser leaks and breaks (tests/serving/test_parsers.py shows each case):
the ``\\n\\n`` before a block and a block cut off by ``max_tokens`` end up in ``content``, a name cut
off mid-way becomes a call, and streamed arguments of a cut-off string value are not JSON.

``ParserEngineToolAdapter`` (vLLM) drives an "engine" object; ``ToolEngine`` is ours and implements
just what that adapter calls. ``structural_tag_model = "deepseek_v4"`` keeps vLLM's DSML grammar for
``tool_choice="required"``/named choices, tools marked ``strict`` (and ``--tool-strict-level``), with
the arguments of a forced call held to the tool's schema (``Dsv4ToolParser.get_structural_tag``).
"""

from __future__ import annotations

from pydantic import BaseModel
from vllm.entrypoints.generate.base.protocol import (
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCallInformation,
    FunctionCall,
    ToolCall,
)
from vllm.parser.engine.adapters import ParserEngineToolAdapter
from vllm.renderers.chat_utils import make_tool_call_id
from xgrammar.structural_tag import JSONSchemaFormat

from vllm_dsv4 import get_logger
from vllm_dsv4.serving.dsml import Delta, DsmlParser

logger = get_logger(__name__)
MAX_WHITESPACE = 2


class ToolEngine:
    """One request's DSML state for the adapter: streaming (``extract_tool_calls_streaming`` then
    ``finish_streaming``) or whole (``extract_tool_calls_from_content``). Input is the answer text
    after reasoning, as vLLM's reasoning parser hands it over."""

    def __init__(self, tokenizer, tools=None, **kwargs) -> None:
        """``tools``: the request's tools; a call to a name not among them is not returned."""
        self.model_tokenizer = tokenizer
        self._declared = None if tools is None else [getattr(t, "function", t).name for t in tools]
        self.skip_reasoning_parsing = False  # vLLM sets it when no reasoning parser is configured
        self._stream: DsmlParser | None = None
        self._ids: list[str] = []

    def adjust_request(self, request):
        request.skip_special_tokens = False  # ｜DSML｜ must reach the parser as text
        return request

    def initialize_streaming(self, initial_state=None) -> None:
        if self._stream is None:
            self._stream = self._parser()

    def extract_tool_calls_streaming(self, previous_text, current_text, delta_text, previous_token_ids,
                                     current_token_ids, delta_token_ids, request) -> DeltaMessage | None:
        self.initialize_streaming()
        return self._delta_message(self._stream.feed(delta_text))

    def finish_streaming(self) -> DeltaMessage | None:
        if self._stream is None:
            return None
        delta = self._stream.finish()
        _warn_undeclared(self._stream)
        return self._delta_message(delta)

    def extract_tool_calls_from_content(self, content: str, request) -> ExtractedToolCallInformation:
        """Whole output: complete calls only. A call cut off by ``max_tokens`` is dropped so the response
        keeps ``finish_reason="length"`` (vLLM reports ``"tool_calls"`` as soon as one call is returned)."""
        parser = self._parser()
        text = parser.feed(content).content + parser.finish().content
        _warn_undeclared(parser)
        calls = [ToolCall(id=make_tool_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
                 for c in parser.calls if c.complete]
        return ExtractedToolCallInformation(tools_called=bool(calls), tool_calls=calls,
                                            content=text if text.strip() or not parser.calls else None)

    def _parser(self) -> DsmlParser:
        return DsmlParser(parse_think=not self.skip_reasoning_parsing, declared=self._declared)

    def _delta_message(self, delta: Delta) -> DeltaMessage | None:
        if not delta:
            return None
        calls = []
        for index in sorted(set(delta.names) | set(delta.arguments)):
            if index in delta.names:
                self._ids.append(make_tool_call_id())
                calls.append(DeltaToolCall(index=index, id=self._ids[index], type="function",
                                           function=DeltaFunctionCall(name=delta.names[index],
                                                                      arguments=delta.arguments.get(index, ""))))
            else:
                calls.append(DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=delta.arguments[index])))
        return DeltaMessage(content=delta.content or None, reasoning=delta.reasoning or None, tool_calls=calls)


def _warn_undeclared(parser: DsmlParser) -> None:
    if parser.undeclared:
        logger.warning("vllm-dsv4: the model called tools the request does not offer, not returned: %s",
                       sorted(set(parser.undeclared)))


class Dsv4ToolParser(ParserEngineToolAdapter):
    """Registered as tool parser ``dsv4_plugin`` (``--tool-call-parser dsv4_plugin``)."""

    _parser_engine_cls = ToolEngine  # type: ignore[assignment]
    structural_tag_model = "deepseek_v4"

    def get_structural_tag(self, request, *, reasoning: bool = False, **kwargs):
        """vLLM's DSML grammar (xgrammar's ``deepseek_v4`` structural tag) for the answer after the
        reasoning; when the request forces a call (``tool_choice`` "required" or a named function), the
        arguments of every tool that does not say ``"strict": false`` follow its JSON schema.
        ``kwargs``: vLLM 0.32's ``strict_level`` (0.26 has none)."""
        tag = super().get_structural_tag(schemas_pinned(request), reasoning=reasoning, **kwargs)
        if tag is not None:
            bound_whitespace(tag)
        return tag


def schemas_pinned(request):
    """``request`` with ``strict`` set on the tools that leave it unset, if its ``tool_choice`` forces a
    call (vLLM 0.32 constrains only the call's envelope for those, so a required call could have
    arguments that break its schema, e.g. ``{}``); else ``request`` itself."""
    if request.tool_choice in (None, "auto", "none") or not request.tools:
        return request
    return request.model_copy(update={"tools": [_strict_unless_declined(tool) for tool in request.tools]})


def bound_whitespace(node) -> None:
    """Caps every whitespace run in the arguments' grammar at ``MAX_WHITESPACE`` (in place): the release
    writes one newline or space between parts, and without a cap a weak model pads until ``max_tokens``."""
    if isinstance(node, JSONSchemaFormat) and node.max_whitespace_cnt is None:
        node.max_whitespace_cnt = MAX_WHITESPACE
    if isinstance(node, BaseModel):
        node = [getattr(node, name) for name in type(node).model_fields]
    if isinstance(node, (list, tuple)):
        for child in node:
            bound_whitespace(child)


def _strict_unless_declined(tool):
    function = getattr(tool, "function", None)  # chat tools wrap the function; Responses tools are it
    target = tool if function is None else function
    if getattr(target, "strict", False) is not None:
        return tool
    strict = target.model_copy(update={"strict": True})
    return strict if function is None else tool.model_copy(update={"function": strict})
