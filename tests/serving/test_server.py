"""The OpenAI server end to end: ``vllm-dsv4 serve CKPT --plugin vllm_dsv4`` (the console script's module,
through vLLM's own ``serve`` command) on the tiny checkpoint, driven with the ``openai`` client.

Random weights never write ``</think>`` or DSML by themselves, so the output-side tests force the model's
tokens with structured outputs (a regex grammar, applied inside reasoning too through
``enable_in_reasoning``); everything after sampling (detokenizer, reasoning and tool parsers, streaming)
is the production path. The request side is checked through the prompt token ids the server returns.
"""

import json
import re

import httpx
import openai
import pytest

from tests.serving.conftest import ENGINE_FLAGS, vllm_server
from tests.serving.test_dsml import D, block, invoke
from tests.serving.test_encoding import GOLDEN, WEATHER

pytestmark = pytest.mark.e2e

FORCE = {"structured_outputs_config": '{"enable_in_reasoning": true}'}
TOOLS = [WEATHER]
CALL = invoke("get_weather", ("city", "true", "Paris"), ("days", "false", "3"))


@pytest.fixture(scope="module")
def server(tiny_ckpt, tmp_path_factory):
    args = ["-m", "vllm_dsv4.serving.cli", "serve", str(tiny_ckpt), "--plugin", "vllm_dsv4", *ENGINE_FLAGS,
            "--structured-outputs-config", FORCE["structured_outputs_config"]]
    with vllm_server(args, tmp_path_factory.mktemp("serve"), {}, drop_env=("VLLM_PLUGINS",)) as (base, log):
        yield base, log


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_ckpt):
    """The checkpoint's tokenizer.json through the ``tokenizers`` library only (no code of ours)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tiny_ckpt / "tokenizer.json"))


def chat(client, messages, **kw):
    return client.chat.completions.create(model="tiny", messages=messages, **kw)


def stream_chat(client, messages, **kw):
    """(reasoning, content, {index: [id, name, args]}, finish_reason, chunks) of a streamed completion."""
    reasoning = content = ""
    calls, finish, chunks = {}, None, 0
    for chunk in chat(client, messages, stream=True, **kw):
        chunks += 1
        for choice in chunk.choices:
            delta = choice.delta
            reasoning += getattr(delta, "reasoning", None) or ""
            content += delta.content or ""
            for tc in delta.tool_calls or []:
                entry = calls.setdefault(tc.index, [tc.id, "", ""])
                entry[1] += (tc.function.name or "") if tc.function else ""
                entry[2] += (tc.function.arguments or "") if tc.function else ""
            finish = choice.finish_reason or finish
    return reasoning or None, content or None, calls, finish, chunks


# </think> and ｜DSML｜ are single tokens (ids from scripts/make_checkpoint.py); the grammar could also spell
# them with ordinary tokens. The bias makes it pick the special token wherever the text allows one, as
# the real model writes them.
MARKER_BIAS = {"5": 100, "7": 100}


def forced(regex, thinking, max_tokens=600, tools=TOOLS):
    body = {"structured_outputs": {"regex": regex}, "chat_template_kwargs": {"thinking": thinking}}
    kw = {"max_tokens": max_tokens, "extra_body": body, "logit_bias": MARKER_BIAS, "temperature": 0}
    if tools:
        kw["tools"] = tools
    return kw


def test_health_and_models(server, client):
    assert httpx.get(server[0] + "/health").status_code == 200
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert "vllm-dsv4: adding --tokenizer-mode dsv4_plugin" in server[1].read_text(errors="replace")


def test_completions(client):
    r = client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=8)
    assert r.object == "text_completion" and isinstance(r.choices[0].text, str)
    assert r.usage.completion_tokens == 8 and r.choices[0].finish_reason == "length"
    chunks = list(client.completions.create(model="tiny", prompt="Hello", max_tokens=4, stream=True))
    assert len(chunks) >= 4 and chunks[-1].choices[0].finish_reason == "length"


E2E_GOLDEN = {  # golden case -> how an OpenAI client asks for it
    "chat": {"extra_body": {"chat_template_kwargs": {"thinking": False}}},
    "thinking_by_default": {},
    "effort_none_is_chat": {"reasoning_effort": "none"},
    "effort_high_adds_nothing": {"reasoning_effort": "high"},
    "effort_max": {"reasoning_effort": "max"},
    "multi_turn_thinking_drops_old_reasoning": {},
    "consecutive_users_merge": {"extra_body": {"chat_template_kwargs": {"thinking": False}}},
    "tool_round_trip_chat": {"tools": TOOLS, "extra_body": {"chat_template_kwargs": {"thinking": False}}},
    "tool_round_trip_thinking_keeps_reasoning": {"tools": TOOLS},
}


@pytest.mark.parametrize("name", sorted(E2E_GOLDEN))
def test_server_renders_the_golden_prompt(client, hf_tokenizer, name):
    """System/user/assistant/tool roles, thinking on/off, reasoning_effort, tools, tool results."""
    messages, _, _, expected = GOLDEN[name]
    kw = dict(E2E_GOLDEN[name])
    kw["extra_body"] = {**kw.get("extra_body", {}), "return_token_ids": True}
    r = chat(client, messages, max_tokens=1, **kw)
    assert r.prompt_token_ids == hf_tokenizer.encode(expected, add_special_tokens=False).ids


@pytest.mark.parametrize("template_kwargs", [{}, {"tokenize": False}])
def test_message_text_cannot_forge_turns(client, hf_tokenizer, template_kwargs):
    """Message text spelling special tokens, DSML and <think> keeps the honest conversation's special ids and
    reaches the model verbatim as ordinary tokens (vLLM asks the template for a string, and so may the request)."""
    from tests.serving.test_message_text import FORGED_TURN, conversation, special_ids
    from vllm_dsv4.serving.encoding import encode_request

    def prompt_ids(text):
        body = {"return_token_ids": True, "chat_template_kwargs": template_kwargs}
        return chat(client, conversation(text)[:4], max_tokens=1, extra_body=body).prompt_token_ids  # fits 2k

    ids = prompt_ids(FORGED_TURN)
    assert special_ids(hf_tokenizer, ids) == special_ids(hf_tokenizer, prompt_ids("x"))
    assert hf_tokenizer.decode(ids, skip_special_tokens=False) == encode_request(conversation(FORGED_TURN)[:4])


def test_chat_shapes(client):
    """Random weights: shapes only. Thinking is on by default, so the output is reasoning."""
    r = chat(client, [{"role": "user", "content": "Hi"}], max_tokens=6)
    choice = r.choices[0]
    assert r.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason == "length" and isinstance(choice.message.reasoning, str)
    assert r.usage.completion_tokens == 6 and r.usage.completion_tokens_details.reasoning_tokens >= 1
    reasoning, content, calls, finish, chunks = stream_chat(
        client, [{"role": "user", "content": "Hi"}], max_tokens=6, stream_options={"include_usage": True})
    assert finish == "length" and reasoning and not calls and chunks >= 3


def test_forced_reasoning_split(client):
    kw = forced(re.escape("I think so.</think>The answer is 4."), thinking=True, tools=None)
    r = chat(client, [{"role": "user", "content": "2+2?"}], **kw)
    assert (r.choices[0].message.reasoning, r.choices[0].message.content) == ("I think so.", "The answer is 4.")
    assert r.choices[0].finish_reason == "stop"
    assert stream_chat(client, [{"role": "user", "content": "2+2?"}], **kw)[:4] == (
        "I think so.", "The answer is 4.", {}, "stop")


@pytest.mark.parametrize("thinking, prefix, reasoning", [
    (False, "Sure.", None), (True, "Need data.</think>Sure.", "Need data.")])
def test_forced_tool_call(client, thinking, prefix, reasoning):
    """A DSML block through the real parser: tool_calls, finish_reason tool_calls, no markup in content."""
    kw = forced(re.escape(prefix + block(CALL)), thinking)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    r = chat(client, messages, **kw)
    msg = r.choices[0].message
    assert (msg.reasoning, msg.content, r.choices[0].finish_reason) == (reasoning, "Sure.", "tool_calls")
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [
        ("get_weather", {"city": "Paris", "days": 3})]
    s_reasoning, content, calls, finish, _ = stream_chat(client, messages, **kw)
    assert (s_reasoning, content, finish) == (reasoning, "Sure.", "tool_calls")
    [(call_id, name, args)] = calls.values()
    assert call_id.startswith("chatcmpl-tool-") and name == "get_weather"
    assert json.loads(args) == {"city": "Paris", "days": 3}


def test_model_made_bad_calls_are_well_formed(client):
    """Malformed JSON in a string="false" value becomes a string; a call to a tool the request does not
    offer is not returned."""
    bad = block(invoke("add", ("a", "false", "{1,"), ("b", "false", "2")), invoke("nope", ("q", "true", "v")))
    add = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}
    kw = forced(re.escape(bad), thinking=False, tools=TOOLS + [add])
    r = chat(client, [{"role": "user", "content": "x"}], **kw)
    got = [(c.function.name, json.loads(c.function.arguments)) for c in r.choices[0].message.tool_calls]
    assert got == [("add", {"a": "{1,", "b": 2})]
    _, content, calls, finish, _ = stream_chat(client, [{"role": "user", "content": "x"}], **kw)
    assert content is None and finish == "tool_calls"
    assert [(n, json.loads(a)) for _, n, a in calls.values()] == got


@pytest.mark.parametrize("max_tokens", [8, 40])
def test_dsml_cut_off_by_max_tokens(client, max_tokens):
    """finish_reason "length"; whole responses drop the unfinished call, streams end it with valid JSON."""
    kw = forced(re.escape("Sure." + block(CALL)), thinking=False, max_tokens=max_tokens)
    r = chat(client, [{"role": "user", "content": "x"}], **kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "length" and msg.content == "Sure." and not msg.tool_calls
    _, content, calls, finish, _ = stream_chat(client, [{"role": "user", "content": "x"}], **kw)
    assert finish == "length" and content == "Sure."
    for _, name, args in calls.values():
        assert name == "get_weather" and isinstance(json.loads(args), dict)


def test_tool_choice_required_uses_the_dsml_grammar(client):
    """vLLM's deepseek_v4 structural tag, arguments held to the schema (our parser's), makes the random
    model write one valid call (tests/serving/test_tool_grammar.py has the full matrix)."""
    tools = [{"type": "function", "function": {"name": "set_unit", "parameters": {
        "type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"]}}}]
    r = chat(client, [{"role": "user", "content": "Unit?"}], tools=tools, tool_choice="required", max_tokens=300,
             temperature=0, parallel_tool_calls=False, extra_body={"chat_template_kwargs": {"thinking": False}})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    [call] = choice.message.tool_calls
    assert call.function.name == "set_unit" and json.loads(call.function.arguments)["unit"] in ("c", "f")


LONG = "Hi " * 2100
BAD_REQUESTS = {  # name: (path, JSON body or raw bytes, text expected in the error message)
    "empty_messages": ("/v1/chat/completions", {"messages": []}, "must not be empty"),
    "invalid_reasoning_effort": ("/v1/chat/completions", {"reasoning_effort": "extreme"}, "reasoning_effort"),
    "invalid_effort_in_template_kwargs": (
        "/v1/chat/completions", {"chat_template_kwargs": {"reasoning_effort": "extreme"}}, "reasoning_effort"),
    "prompt_over_max_model_len": ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]},
                                  "maximum context length"),
    "max_tokens_over_max_model_len": ("/v1/chat/completions", {"max_tokens": 5000}, "max_tokens"),
    "completion_prompt_over_max_model_len": ("/v1/completions", {"prompt": LONG}, "maximum context length"),
    "unknown_tool_choice": ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    "image_part": ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
        ""),
    "non_utf8_bytes": ("/v1/chat/completions",
                       b'{"model": "tiny", "messages": [{"role": "user", "content": "\xff\xfe bad"}]}', ""),
    "lone_surrogate": (
        "/v1/chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "bad \\ud800 text"}]}',
        "surrogate"),
    "not_json": ("/v1/chat/completions", b'{"model": "tiny", "messages": [', ""),
    "deeply_nested_history_arguments": ("/v1/chat/completions", {"messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "tool_calls": [{"id": "a", "type": "function", "function": {
            "name": "f", "arguments": "[" * 50_000 + "]" * 50_000}}]},
        {"role": "tool", "tool_call_id": "a", "content": "r"}]}, "nest deeper than 64 levels"),
}


def test_bad_input_gets_4xx_and_the_server_keeps_serving(server, client):
    base = server[0]
    failures = []
    for name, (path, body, expected) in BAD_REQUESTS.items():
        if isinstance(body, bytes):
            r = httpx.post(base + path, content=body, headers={"content-type": "application/json"}, timeout=60)
        else:
            full = {"model": "tiny", "max_tokens": 4, **body}
            if path.endswith("chat/completions"):
                full.setdefault("messages", [{"role": "user", "content": "hi"}])
            r = httpx.post(base + path, json=full, timeout=60)
        if not (400 <= r.status_code < 500 and expected.lower() in r.text.lower()):
            failures.append(f"{name}: {r.status_code} {r.text[:300]}")
    assert not failures, "\n".join(failures)
    assert httpx.get(base + "/health").status_code == 200
    r = chat(client, [{"role": "user", "content": "Still there?"}], max_tokens=3)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3


def test_history_arguments_that_are_not_an_object(client, hf_tokenizer):
    """vLLM turns them into {} (with a warning) before rendering, so the conversation can go on."""
    history = [{"role": "user", "content": "x"},
               {"role": "assistant", "tool_calls": [{"id": "a", "type": "function",
                                                     "function": {"name": "f", "arguments": "[1, 2]"}}]},
               {"role": "tool", "tool_call_id": "a", "content": "r"}]
    r = chat(client, history, max_tokens=1, extra_body={"return_token_ids": True})
    prompt = hf_tokenizer.decode(r.prompt_token_ids, skip_special_tokens=False)
    assert f'<{D}invoke name="f">\n\n</{D}invoke>' in prompt and "<tool_result>r</tool_result>" in prompt
