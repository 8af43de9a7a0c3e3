"""Tool parser ``dsv4_plugin``: DSML tool calls through ``dsml.DsmlParser``, plugged into vLLM 0.32's
engine-based parser protocol.

vLLM composes a reasoning parser and a tool parser per request (``DelegatingParser``). We keep vLLM's
``deepseek_v4`` reasoning parser, which splits ``<think>`` correctly, and replace the tool side, where
vLLM's ``deepseek_v4`` tool parser leaks and breaks (tests/serving/test_parsers.py shows each case):
the ``\\n\\n`` before a block and a block cut off by ``max_tokens`` end up in ``content``, a name cut
off mid-way becomes a call, and streamed arguments of a cut-off string value are not JSON.

``ParserEngineToolAdapter`` (vLLM) drives an "engine" object; ``ToolEngine`` is ours and implements
just what that adapter calls. ``structural_tag_model = "deepseek_v4"`` keeps vLLM's DSML grammar for
``tool_choice="required"``/named choices (and ``--tool-strict-level``).
"""

from __future__ import annotations

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

from vllm_dsv4.serving.dsml import Delta, DsmlParser


class ToolEngine:
    """One request's DSML state for the adapter: streaming (``extract_tool_calls_streaming`` then
    ``finish_streaming``) or whole (``extract_tool_calls_from_content``). Input is the answer text
    after reasoning, as vLLM's reasoning parser hands it over."""

    def __init__(self, tokenizer, tools=None, **kwargs) -> None:
        self.model_tokenizer = tokenizer
        self.skip_reasoning_parsing = False  # vLLM sets it when no reasoning parser is configured
        self._stream: DsmlParser | None = None
        self._ids: list[str] = []

    def adjust_request(self, request):
        request.skip_special_tokens = False  # ｜DSML｜ must reach the parser as text
        return request

    def initialize_streaming(self, initial_state=None) -> None:
        if self._stream is None:
            self._stream = DsmlParser(parse_think=not self.skip_reasoning_parsing)

    def extract_tool_calls_streaming(self, previous_text, current_text, delta_text, previous_token_ids,
                                     current_token_ids, delta_token_ids, request) -> DeltaMessage | None:
        self.initialize_streaming()
        return self._delta_message(self._stream.feed(delta_text))

    def finish_streaming(self) -> DeltaMessage | None:
        return None if self._stream is None else self._delta_message(self._stream.finish())

    def extract_tool_calls_from_content(self, content: str, request) -> ExtractedToolCallInformation:
        """Whole output: complete calls only. A call cut off by ``max_tokens`` is dropped so the response
        keeps ``finish_reason="length"`` (vLLM reports ``"tool_calls"`` as soon as one call is returned)."""
        parser = DsmlParser(parse_think=not self.skip_reasoning_parsing)
        text = parser.feed(content).content + parser.finish().content
        calls = [ToolCall(id=make_tool_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
                 for c in parser.calls if c.complete]
        return ExtractedToolCallInformation(tools_called=bool(calls), tool_calls=calls,
                                            content=text if text.strip() or not parser.calls else None)

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


class Dsv4ToolParser(ParserEngineToolAdapter):
    """Registered as tool parser ``dsv4_plugin`` (``--tool-call-parser dsv4_plugin``)."""

    _parser_engine_cls = ToolEngine  # type: ignore[assignment]
    structural_tag_model = "deepseek_v4"
