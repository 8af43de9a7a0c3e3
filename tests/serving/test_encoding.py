"""Golden DeepSeek-V4 prompts: our encoder against strings written by hand from the releases' format
(docs/MODEL.md §10 and the releases' ``encoding/encoding_dsv4.py`` rules), never from our code; and against
the release encoder vLLM 0.32 ships (the 0731 one) wherever it applies.
"""

import json

import pytest

from vllm_dsv4.serving.encoding import PREVIEW, R0731, EncodingError, encode_request

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
U, A = "<｜User｜>", "<｜Assistant｜>"
D = "｜DSML｜"

MAX_EFFORT = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root cause, "
    "rigorously stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)
# 0731's "max" (note the em dash)
BEYOND_MAX_EFFORT = (
    "Reasoning Effort: Beyond maximum \u2014 exhaustive, relentless, and uncompromising.\n"
    "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: exhaustively decompose "
    "the problem into its most fundamental components, trace every causal chain to its root, and resolve the "
    "underlying cause rather than any surface symptom.\n"
    "Do not stop reasoning until you have independently verified the solution from multiple angles and are certain "
    "that no assumption remains unchecked and no error remains undiscovered.\n\n"
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                       "required": ["city"]},
    },
}
WEATHER_SCHEMA_LINE = ('{"name": "get_weather", "description": "Weather of a city", "parameters": '
                       '{"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, '
                       '"required": ["city"]}}')


def tools_section(schema_lines: str) -> str:
    return (
        "## Tools\n\n"
        "You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "
        '"<｜DSML｜tool_calls>" block like the following:\n\n'
        "<｜DSML｜tool_calls>\n"
        '<｜DSML｜invoke name="$TOOL_NAME">\n'
        '<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>\n'
        "...\n"
        "</｜DSML｜invoke>\n"
        '<｜DSML｜invoke name="$TOOL_NAME2">\n'
        "...\n"
        "</｜DSML｜invoke>\n"
        "</｜DSML｜tool_calls>\n\n"
        'String parameters should be specified as is and set `string="true"`. For all other types (numbers, '
        'booleans, arrays, objects), pass the value in JSON format and set `string="false"`.\n\n'
        "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside "
        "<think>...</think> BEFORE any tool calls or final response.\n\n"
        "Otherwise, output directly after </think> with tool calls or final response.\n\n"
        "### Available Tool Schemas\n\n"
        f"{schema_lines}\n\n"
        "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
    )


def call(id_, name, args):
    return {"id": id_, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def user(text):
    return {"role": "user", "content": text}


CHAT = {"thinking": False}

GOLDEN = {
    "chat": ([user("Hello")], {}, CHAT, f"{BOS}{U}Hello{A}</think>"),
    "thinking_by_default": ([user("Hello")], {}, {}, f"{BOS}{U}Hello{A}<think>"),
    "enable_thinking_false": ([user("Hello")], {}, {"enable_thinking": False}, f"{BOS}{U}Hello{A}</think>"),
    "effort_none_is_chat": ([user("Hello")], {}, {"reasoning_effort": "none"}, f"{BOS}{U}Hello{A}</think>"),
    "effort_high_adds_nothing": ([user("Hello")], {}, {"reasoning_effort": "high"}, f"{BOS}{U}Hello{A}<think>"),
    "effort_low_is_high": ([user("Hello")], {}, {"reasoning_effort": "low"}, f"{BOS}{U}Hello{A}<think>"),
    "effort_max": ([{"role": "system", "content": "You are terse."}, user("Hi")], {}, {"reasoning_effort": "max"},
                   f"{BOS}{MAX_EFFORT}You are terse.{U}Hi{A}<think>"),
    "effort_xhigh_is_max": ([user("Hi")], {}, {"reasoning_effort": "xhigh"}, f"{BOS}{MAX_EFFORT}{U}Hi{A}<think>"),
    "effort_max_in_chat_mode": ([user("Hi")], {}, {"reasoning_effort": "max", "thinking": False},
                                f"{BOS}{U}Hi{A}</think>"),
    "system_user": ([{"role": "system", "content": "Be brief."}, user("Hi")], {}, CHAT,
                    f"{BOS}Be brief.{U}Hi{A}</think>"),
    "multi_turn_thinking_drops_old_reasoning": (
        [user("a"), {"role": "assistant", "content": "b", "reasoning_content": "r"}, user("c")], {}, {},
        f"{BOS}{U}a{A}</think>b{EOS}{U}c{A}<think>"),
    "multi_turn_reasoning_field_name": (
        [user("a"), {"role": "assistant", "content": "b", "reasoning": "r"}, user("c")], {}, {},
        f"{BOS}{U}a{A}</think>b{EOS}{U}c{A}<think>"),
    "multi_turn_chat": ([user("a"), {"role": "assistant", "content": "b"}, user("c")], {}, CHAT,
                        f"{BOS}{U}a{A}</think>b{EOS}{U}c{A}</think>"),
    "consecutive_users_merge": ([user("a"), user("b")], {}, CHAT, f"{BOS}{U}a\n\nb{A}</think>"),
    "text_parts_join_with_blank_line": (
        [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}], {}, CHAT,
        f"{BOS}{U}a\n\nb{A}</think>"),
    "developer": ([{"role": "developer", "content": "Rules."}, user("Hi")], {}, CHAT,
                  f"{BOS}{U}Rules.{U}Hi{A}</think>"),
    "trailing_system_opens_nothing": ([{"role": "system", "content": "S"}], {}, CHAT, f"{BOS}S"),
    "continue_final_message": ([user("Hi"), {"role": "assistant", "content": "Hel"}], {},
                               {**CHAT, "continue_final_message": True}, f"{BOS}{U}Hi{A}</think>Hel"),
    "tools_synthesize_system": ([user("Weather?")], {"tools": [WEATHER]}, CHAT,
                                f"{BOS}\n\n{tools_section(WEATHER_SCHEMA_LINE)}{U}Weather?{A}</think>"),
}


def agent_turns(thinking_reasoning: str | None):
    """System, user, assistant calling two tools, results in reverse order, the next user turn."""
    assistant = {"role": "assistant", "content": "Let me check.",
                 "tool_calls": [call("c1", "get_weather", {"city": "Paris"}),
                                call("c2", "get_weather", {"city": "Rome", "days": 2})]}
    if thinking_reasoning is not None:
        assistant["reasoning_content"] = thinking_reasoning
    return [
        {"role": "system", "content": "S"},
        user("Paris and Rome?"),
        assistant,
        {"role": "tool", "tool_call_id": "c2", "content": "rainy"},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        user("Thanks, and tomorrow?"),
    ]


CALLS_BLOCK = (
    f'\n\n<{D}tool_calls>\n'
    f'<{D}invoke name="get_weather">\n<{D}parameter name="city" string="true">Paris</{D}parameter>\n</{D}invoke>\n'
    f'<{D}invoke name="get_weather">\n<{D}parameter name="city" string="true">Rome</{D}parameter>\n'
    f'<{D}parameter name="days" string="false">2</{D}parameter>\n</{D}invoke>\n'
    f'</{D}tool_calls>'
)
RESULTS = "<tool_result>sunny</tool_result>\n\n<tool_result>rainy</tool_result>\n\nThanks, and tomorrow?"

GOLDEN["tool_round_trip_chat"] = (
    agent_turns(None), {"tools": [WEATHER]}, CHAT,
    f"{BOS}S\n\n{tools_section(WEATHER_SCHEMA_LINE)}{U}Paris and Rome?{A}</think>Let me check.{CALLS_BLOCK}{EOS}"
    f"{U}{RESULTS}{A}</think>")
# With tools, reasoning of earlier turns is kept and every turn opens <think>.
GOLDEN["tool_round_trip_thinking_keeps_reasoning"] = (
    agent_turns("Need both cities."), {"tools": [WEATHER]}, {},
    f"{BOS}S\n\n{tools_section(WEATHER_SCHEMA_LINE)}{U}Paris and Rome?{A}<think>Need both cities.</think>"
    f"Let me check.{CALLS_BLOCK}{EOS}{U}{RESULTS}{A}<think>")
GOLDEN["argument_types"] = (
    [user("x"), {"role": "assistant", "content": None, "tool_calls": [
        {"id": "k", "type": "function", "function": {"name": "f", "arguments": json.dumps(
            {"s": "é\"q", "b": True, "n": None, "l": [1, 2], "o": {"a": "é"}, "x": 1.5}, ensure_ascii=False)}}]}],
    {}, CHAT,
    f'{BOS}{U}x{A}</think>\n\n<{D}tool_calls>\n<{D}invoke name="f">\n'
    f'<{D}parameter name="s" string="true">é"q</{D}parameter>\n'
    f'<{D}parameter name="b" string="false">true</{D}parameter>\n'
    f'<{D}parameter name="n" string="false">null</{D}parameter>\n'
    f'<{D}parameter name="l" string="false">[1, 2]</{D}parameter>\n'
    f'<{D}parameter name="o" string="false">{{"a": "é"}}</{D}parameter>\n'
    f'<{D}parameter name="x" string="false">1.5</{D}parameter>\n'
    f'</{D}invoke>\n</{D}tool_calls>{EOS}')
GOLDEN["unparsable_history_arguments_kept_as_string"] = (
    [user("x"), {"role": "assistant", "tool_calls": [
        {"id": "k", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}], {}, CHAT,
    f'{BOS}{U}x{A}</think>\n\n<{D}tool_calls>\n<{D}invoke name="f">\n'
    f'<{D}parameter name="arguments" string="true">{{oops</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>{EOS}')
GOLDEN["tool_result_then_thinking_turn"] = (
    [user("q"), {"role": "assistant", "content": "", "reasoning_content": "r", "tool_calls": [call("t", "f", {})]},
     {"role": "tool", "tool_call_id": "t", "content": "42"}], {}, {},
    f"{BOS}{U}q{A}</think>\n\n<{D}tool_calls>\n<{D}invoke name=\"f\">\n\n</{D}invoke>\n</{D}tool_calls>{EOS}"
    f"{U}<tool_result>42</tool_result>{A}<think>")


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_golden(name):
    messages, extra, kwargs, expected = GOLDEN[name]
    assert encode_request(messages, extra.get("tools"), **kwargs) == expected


def test_encoder_does_not_mutate_request():
    messages = agent_turns("r")
    before = json.dumps(messages)
    encode_request(messages, [WEATHER], thinking=True)
    assert json.dumps(messages) == before


@pytest.fixture(scope="module")
def tokenizer(tiny_ckpt):
    from vllm_dsv4.serving.tokenizer import Dsv4Tokenizer

    return Dsv4Tokenizer.from_pretrained(str(tiny_ckpt))


@pytest.mark.parametrize("kwargs, thinking", [
    ({}, True), ({"thinking": True}, True), ({"thinking": False}, False), ({"enable_thinking": False}, False),
    ({"enable_thinking": True}, True), ({"reasoning_effort": "none"}, False),
    ({"thinking": True, "reasoning_effort": "none"}, False), ({"thinking": False, "enable_thinking": True}, True),
])
def test_thinking_rule_matches_vllm_reasoning_parser(tokenizer, kwargs, thinking):
    """The prompt's <think>/</think> and vLLM's deepseek_v4 reasoning parser must agree: the parser reads
    the same kwargs to decide whether the output starts inside reasoning."""
    from vllm.parser.deepseek_v4 import DeepSeekV4Parser
    from vllm.parser.engine.parser_engine_config import ParserState

    prompt = encode_request([user("Hi")], **kwargs)
    assert prompt.endswith("<think>" if thinking else "</think>")
    parser = DeepSeekV4Parser(tokenizer, None, chat_template_kwargs=dict(kwargs))
    assert (parser.parser_engine_config.initial_state == ParserState.REASONING) is thinking


@pytest.mark.parametrize("messages, kwargs, match", [
    ([], {}, "must not be empty"),
    ([user("hi")], {"reasoning_effort": "bogus"}, "reasoning_effort"),
    ([user("hi")], {"reasoning_effort": 3}, "reasoning_effort"),
    ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}], {}, "part 'input_audio'"),
    ([user("x"), {"role": "assistant", "tool_calls": [call("k", "f", {})]},
      {"role": "tool", "tool_call_id": "k", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], {},
     "not in tool results"),
    ([{"role": "narrator", "content": "x"}], {}, "no 'narrator' role"),
    ([{"content": "x"}], {}, "needs a role"),
    ([{"role": "developer", "content": ""}], {}, "developer"),
    ([user("x"), {"role": "assistant", "tool_calls": [call("k", "f", [1, 2])]}], {}, "JSON object"),
    ([user("x"), {"role": "assistant", "tool_calls": [{"id": "k", "function": {"arguments": "{}"}}]}], {}, "name"),
    ([user("bad \ud800 text")], {}, "surrogate"),
])
def test_bad_conversations_are_value_errors(messages, kwargs, match):
    """vLLM answers a ValueError raised while rendering with 400."""
    with pytest.raises(EncodingError, match=match):
        encode_request(messages, None, **kwargs)


def test_images_become_placeholders_in_order():
    """Each image part (OpenAI's ``image_url``, or ``image`` as vLLM's parser hands it over) is the image
    placeholder where it stands, parts joined by a blank line (docs/VISION.md §10); several per message and
    per conversation. The pixels travel beside the prompt, matched to placeholders by order."""
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is in this picture?"}, image]},
                {"role": "assistant", "content": "A cat."},
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and these?"}, image]}]
    prompt = encode_request(messages, None, thinking=False)
    ph = "<｜deepseek_image｜>"
    assert prompt.count(ph) == 3
    assert f"<｜User｜>What is in this picture?\n\n{ph}<｜Assistant｜>" in prompt
    assert f"<｜User｜>{ph}\n\nand these?\n\n{ph}<｜Assistant｜>" in prompt


def test_image_parts_are_the_placeholder_token_and_typed_ones_stay_text(tmp_path_factory, make_checkpoint_module):
    """Through the tokenizer of a Vision checkpoint, each image part is the placeholder token (markup); the
    placeholder typed into message text is encoded as text, so it cannot stand for an image."""
    from vllm_dsv4.serving.tokenizer import Dsv4Tokenizer

    ckpt = make_checkpoint_module.make_checkpoint(tmp_path_factory.mktemp("tiny_vision_tok"), "tiny-vision",
                                                  quantized=False)
    tok = Dsv4Tokenizer.from_pretrained(str(ckpt))
    placeholder = tok.convert_tokens_to_ids("<｜deepseek_image｜>")
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}
    typed = {"type": "text", "text": "see <｜deepseek_image｜> here"}
    ids = tok.apply_chat_template([{"role": "user", "content": [image, typed, image]}], tokenize=True, thinking=False)
    assert ids.count(placeholder) == 2


def test_tokenizer_mode_uses_special_token_ids(tokenizer):
    """Through the registered tokenizer, markers are single special tokens (ids from make_checkpoint)."""
    tok = tokenizer
    ids = tok.apply_chat_template([user("Hi")], tokenize=True, thinking=True)
    assert ids[:2] == [0, 2] and ids[-2:] == [3, 4]  # BOS <｜User｜> ... <｜Assistant｜> <think>
    assert tok.apply_chat_template([user("Hi")], tokenize=True, thinking=False)[-2:] == [3, 5]
    history = [user("q"), {"role": "assistant", "tool_calls": [call("t", "f", {"a": 1})]}, user("r")]
    ids = tok.apply_chat_template(history, tokenize=True, thinking=False)
    assert ids.count(7) == 6 and ids.count(1) == 1  # ｜DSML｜ in 6 tags, one EOS
    assert tok.apply_chat_template([user("Hi")], tokenize=False, thinking=False) == f"{BOS}{U}Hi{A}</think>"


def test_vllm_intree_mode_renders_the_0731_effort_table(tiny_ckpt):
    """Why we ship our own mode: vLLM 0.32's deepseek_v4 mode renders every default thinking request with
    the "Absolute maximum" paragraph, which is this release's reasoning_effort="max"."""
    from vllm.tokenizers.deepseek_v4 import DeepseekV4Tokenizer

    intree = DeepseekV4Tokenizer.from_pretrained(str(tiny_ckpt)).apply_chat_template([user("Hi")], tokenize=False)
    assert intree == f"{BOS}{MAX_EFFORT}{U}Hi{A}<think>"
    assert encode_request([user("Hi")]) == f"{BOS}{U}Hi{A}<think>"


# Each release's rules, written out: OpenAI reasoning_effort (None: not given) -> the paragraph a thinking
# request starts with. The preview has one paragraph, for its "max" (DeepSeek's API maps xhigh to max and
# low / minimal / medium to high, which adds nothing); 0731 has "high" (the preview's paragraph) and "max"
# (a new one), and vLLM's mapping (no effort -> high, minimal / medium -> low, xhigh -> high).
EFFORT_RULES = {
    "preview": {None: "", "minimal": "", "low": "", "medium": "", "high": "", "xhigh": MAX_EFFORT, "max": MAX_EFFORT},
    "0731": {None: MAX_EFFORT, "minimal": "", "low": "", "medium": "", "high": MAX_EFFORT, "xhigh": MAX_EFFORT,
             "max": BEYOND_MAX_EFFORT},
}
RELEASE = {"preview": PREVIEW, "0731": R0731}
EFFORT_CASES = [(r, e) for r, table in EFFORT_RULES.items() for e in table]


def effort_kwargs(effort):
    return {} if effort is None else {"reasoning_effort": effort}


@pytest.mark.parametrize("release, effort", EFFORT_CASES)
def test_effort_table_per_release(release, effort):
    """Thinking mode: the release's paragraph before the first message; chat mode: none, whatever the effort."""
    messages, rel = [{"role": "system", "content": "S"}, user("Hi")], RELEASE[release]
    thinking = encode_request(messages, release=rel, **effort_kwargs(effort))
    assert thinking == f"{BOS}{EFFORT_RULES[release][effort]}S{U}Hi{A}<think>"
    chat = encode_request(messages, release=rel, thinking=False, **effort_kwargs(effort))
    assert chat == f"{BOS}S{U}Hi{A}</think>"


@pytest.mark.parametrize("release", sorted(RELEASE))
def test_effort_none_and_unknown_values_per_release(release):
    assert encode_request([user("Hi")], release=RELEASE[release], reasoning_effort="none") == f"{BOS}{U}Hi{A}</think>"
    with pytest.raises(EncodingError, match="reasoning_effort"):
        encode_request([user("Hi")], release=RELEASE[release], reasoning_effort="extreme")


@pytest.fixture(scope="module")
def vllm_encoder(tiny_ckpt):
    """vLLM 0.32's deepseek_v4 tokenizer mode (its copy of the 0731 release encoder), as a string renderer."""
    from transformers import TokenizersBackend
    from vllm.tokenizers.deepseek_v4 import get_deepseek_v4_tokenizer

    tok = get_deepseek_v4_tokenizer(TokenizersBackend.from_pretrained(str(tiny_ckpt)))
    return lambda messages, tools=None, **kw: tok.apply_chat_template(messages, tools, tokenize=False, **kw)


@pytest.mark.parametrize("effort", list(EFFORT_RULES["0731"]) + ["none"])
def test_0731_release_equals_vllm_encoder(vllm_encoder, effort):
    """Our 0731 table and request mapping against vLLM's, thinking by default and off."""
    messages = [{"role": "system", "content": "S"}, user("Hi")]
    for thinking in ({}, {"thinking": False}):
        kw = {**effort_kwargs(effort), **thinking}
        assert encode_request(messages, release=R0731, **kw) == vllm_encoder(messages, **kw)


# Golden cases where vLLM's copy differs from the release's rules, and why.
VLLM_DIFFERS = {
    "trailing_system_opens_nothing": "vLLM #51262 opens an assistant turn after a trailing system message",
    "unparsable_history_arguments_kept_as_string": "vLLM's chat parser coerces such arguments before its encoder, "
                                                   "which raises on them; the release keeps them as one string",
}
PREVIEW_AS_0731 = {"high": "low", "max": "high"}  # a preview level -> the 0731 level with the same paragraph


@pytest.mark.parametrize("name", sorted(set(GOLDEN) - set(VLLM_DIFFERS)))
def test_golden_equals_vllm_encoder(vllm_encoder, name):
    """The hand-written preview goldens through vLLM's encoder, asked for the 0731 level whose paragraph is the
    preview level's; as vLLM's chat parser hands it messages (``reasoning``), and ``continue_final_message`` as
    the release's ``wo_eos`` (vLLM's tokenizer mode does not translate it)."""
    messages, extra, kwargs, expected = GOLDEN[name]
    kw = dict(kwargs)
    if kw.get("reasoning_effort") != "none":
        level = PREVIEW.levels.get(kw.get("reasoning_effort"), PREVIEW.default)
        kw["reasoning_effort"] = PREVIEW_AS_0731[level]
    messages = [{("reasoning" if k == "reasoning_content" else k): v for k, v in m.items()} for m in messages]
    if kw.pop("continue_final_message", False):
        messages[-1] = {**messages[-1], "wo_eos": True}
    assert vllm_encoder(messages, extra.get("tools"), **kw) == expected


def _checkpoint_files(src, dst, config_edit=None, encoder=None):
    """A copy of ``src``'s tokenizer files and config (``config_edit(raw)`` applied; None: no config.json),
    with ``encoder`` as the release encoder's source text when given."""
    import shutil

    dst.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, dst / name)
    if config_edit is not None:
        raw = json.loads((src / "config.json").read_text())
        config_edit(raw)
        (dst / "config.json").write_text(json.dumps(raw))
    if encoder is not None:
        (dst / "encoding").mkdir()
        (dst / "encoding" / "encoding_dsv4.py").write_text(encoder)
    return dst


def _dspark(raw):
    raw.update(dspark_block_size=5, dspark_noise_token_id=2, dspark_target_layer_ids=[1, 2, 3], dspark_markov_rank=8)


PREVIEW_ENCODER = 'REASONING_EFFORT_MAX = ("Reasoning Effort: Absolute maximum with no shortcuts permitted.\\n")'
ENCODER_0731 = PREVIEW_ENCODER + '\nMAX = "Reasoning Effort: Beyond maximum \\u2014 exhaustive"'
RELEASE_CHECKPOINTS = {  # name -> (config edit, encoder source, release the plugin mode must pick)
    "april_config": (lambda raw: None, None, "preview"),
    "dspark_config": (_dspark, None, "0731"),
    "dspark_config_preview_encoder": (_dspark, PREVIEW_ENCODER, "preview"),
    "april_config_0731_encoder": (lambda raw: None, ENCODER_0731, "0731"),
    "encoder_only": (None, ENCODER_0731, "0731"),
}


@pytest.mark.parametrize("name", sorted(RELEASE_CHECKPOINTS))
def test_release_told_from_the_checkpoint(tiny_ckpt, tmp_path, name):
    """``dsv4_plugin`` takes the effort table of the encoder the checkpoint ships, else of its config's
    era (DSpark keys: 0731); the forced modes take theirs whatever the checkpoint says."""
    from vllm_dsv4.serving.tokenizer import Dsv4PreviewTokenizer, Dsv4Tokenizer, Dsv4Tokenizer0731

    edit, encoder, release = RELEASE_CHECKPOINTS[name]
    path = str(_checkpoint_files(tiny_ckpt, tmp_path / name, edit, encoder))
    paragraph = {"preview": MAX_EFFORT, "0731": BEYOND_MAX_EFFORT}
    for mode, want in ((Dsv4Tokenizer, release), (Dsv4PreviewTokenizer, "preview"), (Dsv4Tokenizer0731, "0731")):
        tok = mode.from_pretrained(path)
        assert tok.apply_chat_template([user("Hi")], tokenize=False, reasoning_effort="max") == \
            f"{BOS}{paragraph[want]}{U}Hi{A}<think>", mode


def test_release_that_cannot_be_told_is_an_error(tiny_ckpt, tmp_path):
    from vllm_dsv4.serving.tokenizer import Dsv4Tokenizer

    path = _checkpoint_files(tiny_ckpt, tmp_path / "bare")
    with pytest.raises(ValueError, match="--tokenizer-mode dsv4_preview or dsv4_0731"):
        Dsv4Tokenizer.from_pretrained(str(path))


def test_rendering_scans_the_conversation_once(monkeypatch):
    """Linear in the number of messages: the last user turn is found once per conversation, not per message."""
    from vllm_dsv4.serving import encoding

    calls = []
    original = encoding.last_user_index
    monkeypatch.setattr(encoding, "last_user_index", lambda messages: calls.append(1) or original(messages))
    turns = [m for i in range(200) for m in (user(f"q{i}"), {"role": "assistant", "content": f"a{i}"})]
    encode_request(turns + [user("last")])
    assert len(calls) <= 2  # the dropped-reasoning pass and the rendering
