"""Reasoning + tool parsing as the server runs it: vLLM's composed parser (``--reasoning-parser deepseek_v4
--tool-call-parser dsv4_plugin``) on hand-written model outputs tokenized with the tiny checkpoint's
tokenizer (real special-token ids), whole (``parse``) and streamed in random token chunks (``parse_delta``).

The last tests run vLLM's own ``deepseek_v4`` tool parser on the same outputs: they pin down what it gets
wrong, which is why we ship ``dsv4_plugin``.
"""

import json
import random

import pytest

from tests.serving.test_dsml import D, block, invoke

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}},
]
WEATHER = invoke("get_weather", ("city", "true", "Paris"), ("days", "false", "3"))
WEATHER_CALL = ("get_weather", {"city": "Paris", "days": 3})
DEEP, SHALLOW = "[" * 5000 + "]" * 5000, "[" * 60 + '"[[[[[[[["' + "]" * 60  # brackets in a string do not nest


@pytest.fixture(scope="module")
def tokenizer(tiny_ckpt):
    from vllm_dsv4 import serving
    from vllm_dsv4.serving.tokenizer import Dsv4Tokenizer

    serving.register()
    return Dsv4Tokenizer.from_pretrained(str(tiny_ckpt))


class Harness:
    """One request through vLLM's parser the way chat_completion/serving.py drives it."""

    def __init__(self, tokenizer, tool_parser="dsv4_plugin", thinking=True, tools=True, tool_choice="auto"):
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.parser.parser_manager import ParserManager

        body = dict(model="m", messages=[{"role": "user", "content": "hi"}],
                    chat_template_kwargs={"thinking": thinking})
        if tools:
            body.update(tools=TOOLS, tool_choice=tool_choice)
        self.request = ChatCompletionRequest(**body)
        self.kwargs = self.request.build_chat_params(None, "auto").chat_template_kwargs
        self.cls = ParserManager.get_parser(tool_parser_name=tool_parser, reasoning_parser_name="deepseek_v4",
                                            enable_auto_tools=True, tokenizer=tokenizer)
        self.tok = tokenizer
        self.prompt_ids = tokenizer.apply_chat_template(body["messages"], body.get("tools"), tokenize=True,
                                                        **self.kwargs)

    def parser(self):
        return self.cls(self.tok, self.request.tools, chat_template_kwargs=self.kwargs)

    def ids(self, text):
        ids = self.tok.encode(text, add_special_tokens=False)
        assert self.tok.decode(ids, skip_special_tokens=False) == text
        return ids

    def whole(self, ids):
        """(reasoning, content, [(name, args dict)]) of a finished output."""
        parser = self.parser()
        parser.set_prompt_token_ids(self.prompt_ids)
        text = self.tok.decode(ids, skip_special_tokens=False)
        reasoning, content, calls = parser.parse(text, self.request, enable_auto_tools=True,
                                                 model_output_token_ids=ids)
        return reasoning, content, [(c.name, json.loads(c.arguments)) for c in calls or []]

    def stream(self, ids, seed=0, max_chunk=1):
        """The same from streamed deltas; also checks each call's id and name arrive once, first."""
        parser, rng = self.parser(), random.Random(seed)
        reasoning = content = ""
        calls: dict[int, dict] = {}
        prev_text, i = "", 0
        while i < len(ids):
            j = min(len(ids), i + rng.randint(1, max_chunk))
            text = self.tok.decode(ids[:j], skip_special_tokens=False)
            while text.endswith("\ufffd") and j < len(ids):  # the detokenizer holds back partial characters
                j += 1
                text = self.tok.decode(ids[:j], skip_special_tokens=False)
            delta = parser.parse_delta(text[len(prev_text):], ids[i:j], self.request, self.prompt_ids,
                                       finished=j == len(ids))
            prev_text, i = text, j
            if delta is None:
                continue
            reasoning += delta.reasoning or ""
            content += delta.content or ""
            for tc in delta.tool_calls:
                if tc.index not in calls:
                    assert tc.id and tc.function.name, "a call must open with its id and name"
                    calls[tc.index] = {"name": tc.function.name, "args": ""}
                else:
                    assert tc.id is None and tc.function.name is None
                calls[tc.index]["args"] += tc.function.arguments or ""
        return reasoning or None, content or None, [(c["name"], c["args"]) for _, c in sorted(calls.items())]


def parsed_stream(result):
    reasoning, content, calls = result
    return reasoning, content, [(name, json.loads(args)) for name, args in calls]


CASES = {  # name: (thinking, model output, expected (reasoning, content, calls))
    "think_answer": (True, "Let me think.</think>The answer is 42.", ("Let me think.", "The answer is 42.", [])),
    "think_text_then_call": (True, "plan</think>Checking." + block(WEATHER), ("plan", "Checking.", [WEATHER_CALL])),
    "think_call": (True, "need data</think>" + block(WEATHER), ("need data", None, [WEATHER_CALL])),
    "call_inside_reasoning": (True, "thinking" + block(WEATHER), ("thinking", None, [WEATHER_CALL])),
    "empty_reasoning": (True, "</think>Hi", (None, "Hi", [])),
    "reasoning_never_closed": (True, "still thinking", ("still thinking", None, [])),
    "chat_answer": (False, "Hello there, how are you?", (None, "Hello there, how are you?", [])),
    "chat_two_calls": (False, "Sure." + block(WEATHER, invoke("add", ("a", "false", "1"), ("b", "false", "2.5"))),
                       (None, "Sure.", [WEATHER_CALL, ("add", {"a": 1, "b": 2.5})])),
    "chat_think_tags": (False, "<think>hmm</think>answer", ("hmm", "answer", [])),
    "malformed_json_argument": (True, "x</think>" + block(invoke("add", ("a", "false", "{1,"), ("b", "false", "2"))),
                                ("x", None, [("add", {"a": "{1,", "b": 2})])),
    "undeclared_tool_is_not_returned": (True, "x</think>" + block(invoke("nope", ("q", "true", "v"))),
                                        ("x", None, [])),
    "undeclared_between_declared": (False, block(WEATHER, invoke("nope", ("q", "false", "[1]")), WEATHER),
                                    (None, None, [WEATHER_CALL, WEATHER_CALL])),
    "json_nested_too_deeply_stays_text": (False, block(invoke("add", ("a", "false", DEEP), ("b", "false", SHALLOW))),
                                          (None, None, [("add", {"a": DEEP, "b": json.loads(SHALLOW)})])),
    "unicode": (True, "思考</think>答案是" + block(invoke("get_weather", ("city", "true", "杭州"))),
                ("思考", "答案是", [("get_weather", {"city": "杭州"})])),
    "string_with_markup": (False, block(invoke("get_weather", ("city", "true", f'a<b>"c"\n</{D}invoke>'))),
                           (None, None, [("get_weather", {"city": f'a<b>"c"\n</{D}invoke>'})])),
    "text_after_block": (True, "x</think>" + block(WEATHER) + "trailing", ("x", None, [WEATHER_CALL])),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_whole_and_streamed(tokenizer, name):
    thinking, text, expected = CASES[name]
    h = Harness(tokenizer, thinking=thinking)
    ids = h.ids(text)
    assert h.whole(ids) == expected
    for seed, max_chunk in [(0, 1), (1, 3), (2, 8), (3, 64)]:
        assert parsed_stream(h.stream(ids, seed, max_chunk)) == expected, (seed, max_chunk)


LONG = "Let me look.</think>Checking both." + block(
    WEATHER, invoke("add", ("a", "false", "[1, 2]"), ("b", "true", "x y")))


def test_cut_off_at_every_token(tokenizer):
    """max_tokens: whole results keep complete calls only; streams may end with a started call, whose
    arguments are still a JSON object. Nothing of the markup reaches content or reasoning."""
    h = Harness(tokenizer, thinking=True)
    ids = h.ids(LONG)
    full = h.whole(ids)
    for cut in range(len(ids) + 1):
        reasoning, content, calls = h.whole(ids[:cut])
        assert calls == full[2][:len(calls)]
        s_reasoning, s_content, s_calls = h.stream(ids[:cut], seed=cut, max_chunk=3)
        assert (s_reasoning, s_content) == (reasoning, content), cut
        for text in (reasoning or "", content or ""):
            assert D not in text and "think>" not in text and not text.endswith("\n\n<"), (cut, text)
        for k, (name, args) in enumerate(s_calls):
            assert name == full[2][k][0] and isinstance(json.loads(args), dict), (cut, args)
        assert len(s_calls) - len(calls) in (0, 1)


@pytest.mark.parametrize("tools, tool_choice", [(True, "none"), (False, None)])
def test_markup_never_in_content_without_tool_choice(tokenizer, tools, tool_choice):
    """tool_choice="none" (or no tools): no tool_calls, and the model's DSML is not passed on as text."""
    h = Harness(tokenizer, thinking=True, tools=tools, tool_choice=tool_choice)
    ids = h.ids("x</think>Checking." + block(WEATHER))
    assert h.whole(ids) == ("x", "Checking.", [])
    assert parsed_stream(h.stream(ids, max_chunk=2)) == ("x", "Checking.", [])


# -- vLLM 0.32's deepseek_v4 tool parser on the same outputs -------------------------------------------


def test_intree_tool_parser_leaks_block_separator(tokenizer):
    h = Harness(tokenizer, tool_parser="deepseek_v4")
    reasoning, content, calls = h.whole(h.ids("plan</think>Checking." + block(WEATHER)))
    assert content == "Checking.\n\n" and calls == [WEATHER_CALL]


def test_intree_tool_parser_leaks_cut_off_block(tokenizer):
    h = Harness(tokenizer, tool_parser="deepseek_v4")
    _, content, _ = h.whole(h.ids(f"x</think>Let me check.\n\n<{D}tool_c"))
    assert content == f"Let me check.\n\n<{D}tool_c"


def test_intree_tool_parser_calls_cut_off_name(tokenizer):
    h = Harness(tokenizer, tool_parser="deepseek_v4")
    _, _, calls = h.whole(h.ids(f'x</think>\n\n<{D}tool_calls>\n<{D}invoke name="get_wea'))
    assert calls == [("get_wea", {})]


def test_intree_tool_parser_streams_invalid_json(tokenizer):
    h = Harness(tokenizer, tool_parser="deepseek_v4")
    text = f'x</think>\n\n<{D}tool_calls>\n<{D}invoke name="get_weather">\n<{D}parameter name="city" string="true">Par'
    _, _, calls = h.stream(h.ids(text))
    with pytest.raises(json.JSONDecodeError):
        json.loads(calls[0][1])
