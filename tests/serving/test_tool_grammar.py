"""Constrained tool calls: ``tool_choice="required"``, a named function and tools marked ``strict`` make
the answer a DSML call whose arguments follow the tool's JSON schema, with thinking off and on (the
reasoning left free).

The grammar is checked two ways: xgrammar's matcher on hand-written DSML (which strings the grammar our
parser hands vLLM admits), and end to end on the tiny checkpoint, whose random weights never write a
call by themselves: only the grammar can make every answer a valid call.
"""

import json

import openai
import pytest
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from xgrammar import Grammar
from xgrammar.testing import _is_grammar_accept_string

from tests.serving.conftest import ENGINE_FLAGS, vllm_server
from tests.serving.test_dsml import D, block, invoke
from vllm_dsv4.serving.tool_parser import Dsv4ToolParser

CITIES = ["Paris", "Lima"]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": CITIES}, "days": {"type": "integer"}},
    "required": ["city"]}}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
OTHER = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def weather(strict: bool | None) -> dict:
    tool = json.loads(json.dumps(WEATHER))
    if strict is not None:
        tool["function"]["strict"] = strict
    return tool


def grammar(tools: list[dict], tool_choice) -> Grammar | None:
    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], tools=tools,
                                    tool_choice=tool_choice)
    tag = Dsv4ToolParser(None, request.tools).get_structural_tag(request, reasoning=False)
    return None if tag is None else Grammar.from_structural_tag(tag)


def call(*params) -> str:
    return block(invoke("get_weather", *params))


VALID = [call(("city", "true", "Paris")), call(("city", "true", "Lima"), ("days", "false", "3"))]
INVALID = {
    "city not in the enum": call(("city", "true", "Rome")),
    "city missing": call(),
    "days not an integer": call(("city", "true", "Paris"), ("days", "false", '"3"')),
    "undeclared parameter": call(("city", "true", "Paris"), ("country", "true", "FR")),
    "undeclared tool": block(invoke("get_time")),
    "no call": "It is sunny.",
    "padded with whitespace": call(("city", "true", "Paris")).replace(f"</{D}parameter>\n", f"</{D}parameter>\n \t \n"),
}


@pytest.mark.parametrize("strict", [None, True])
@pytest.mark.parametrize("tool_choice", ["required", NAMED])
def test_a_forced_call_follows_the_schema(tool_choice, strict):
    g = grammar([weather(strict), OTHER] if tool_choice == "required" else [weather(strict)], tool_choice)
    assert all(_is_grammar_accept_string(g, text) for text in VALID)
    admitted = [name for name, text in INVALID.items()
                if name != "undeclared tool" or tool_choice != "required"
                if _is_grammar_accept_string(g, text)]
    assert admitted == []


def test_a_tool_that_declines_strictness_keeps_free_arguments_in_a_forced_call():
    g = grammar([weather(False)], "required")
    assert _is_grammar_accept_string(g, INVALID["city missing"])
    assert not _is_grammar_accept_string(g, INVALID["no call"])


def test_auto_constrains_the_calls_to_strict_tools_only():
    assert grammar([weather(None)], "auto") is None  # nothing forced, nothing strict: the model is free
    g = grammar([weather(True)], "auto")
    assert _is_grammar_accept_string(g, "It is sunny.") and _is_grammar_accept_string(g, "Let me check." + VALID[0])
    assert not _is_grammar_accept_string(g, "Let me check." + INVALID["city missing"])


# ---------------------------------------------------------------------------------------------- e2e

BUDGET = 8  # reasoning tokens: random weights would never end the reasoning themselves


@pytest.fixture(scope="module")
def client(tiny_ckpt, tmp_path_factory):
    """A server that constrains the answer only (vLLM's default): the reasoning stays free."""
    args = ["-m", "vllm_dsv4.serving.cli", "serve", str(tiny_ckpt), "--plugin", "vllm_dsv4", *ENGINE_FLAGS,
            "--reasoning-config", json.dumps({"reasoning_start_str": "<think>", "reasoning_end_str": "</think>"})]
    with vllm_server(args, tmp_path_factory.mktemp("grammar"), {}, drop_env=("VLLM_PLUGINS",)) as (base, _):
        yield openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=300)


def calls_of(client, tool_choice, strict, thinking, stream):
    """(finish_reason, reasoning, [(name, arguments)]) of one greedy request."""
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Weather?"}], tools=[weather(strict)],
              tool_choice=tool_choice, parallel_tool_calls=False, max_tokens=200, temperature=0,
              extra_body={"chat_template_kwargs": {"thinking": thinking}, "thinking_token_budget": BUDGET})
    if not stream:
        r = client.chat.completions.create(**kw)
        msg = r.choices[0].message
        return (r.choices[0].finish_reason, getattr(msg, "reasoning", None),
                [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls or []])
    reasoning, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning", None) or ""
            for tc in choice.delta.tool_calls or []:
                entry = calls.setdefault(tc.index, ["", ""])
                entry[0] += tc.function.name or ""
                entry[1] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    return finish, reasoning or None, [(name, json.loads(args)) for name, args in calls.values()]


@pytest.mark.e2e
@pytest.mark.parametrize("thinking", [False, True])
@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_random_weights_make_a_valid_call_every_time(client, tool_choice, thinking):
    for strict in (None, True):
        for stream in (False, True):
            finish, reasoning, calls = calls_of(client, tool_choice, strict, thinking, stream)
            assert finish == ("tool_calls" if tool_choice == "required" else "stop"), (strict, stream, finish, calls)
            [(name, arguments)] = calls
            assert name == "get_weather" and set(arguments) <= {"city", "days"} and arguments["city"] in CITIES
            assert isinstance(arguments.get("days", 0), int)
            assert bool(reasoning) == thinking  # the reasoning was left to the model
