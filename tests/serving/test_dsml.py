"""DsmlParser on hand-written model outputs: whole, in random chunk sizes, and cut off at every character."""

import json
import random

import pytest

from vllm_dsv4.serving.dsml import DsmlParser

D = "｜DSML｜"


def invoke(name, *params):
    lines = "".join(f'<{D}parameter name="{k}" string="{s}">{v}</{D}parameter>\n' for k, s, v in params)
    return f'<{D}invoke name="{name}">\n{lines}</{D}invoke>'


def block(*invokes):
    return f"\n\n<{D}tool_calls>\n" + "\n".join(invokes) + f"\n</{D}tool_calls>"


def run(text, chunks=None, parse_think=True):
    """(content, reasoning, [(name, arguments, complete)]) with ``text`` fed in ``chunks`` pieces."""
    p = DsmlParser(parse_think=parse_think)
    pieces = [text] if chunks is None else chunks
    content = reasoning = ""
    streamed: dict[int, list[str]] = {}
    for piece in pieces:
        for d in (p.feed(piece),):
            content += d.content
            reasoning += d.reasoning
            for i, name in d.names.items():
                streamed[i] = [name, ""]
            for i, a in d.arguments.items():
                streamed[i][1] += a
    d = p.finish()
    content += d.content
    reasoning += d.reasoning
    for i, a in d.arguments.items():
        streamed[i][1] += a
    calls = [(c.name, c.arguments, c.complete) for c in p.calls]
    assert [(n, a) for n, a, _ in calls] == [tuple(streamed[i]) for i in sorted(streamed)], "deltas != final calls"
    return content, reasoning, calls


def random_chunks(text, seed, max_len):
    rng, out, i = random.Random(seed), [], 0
    while i < len(text):
        n = rng.randint(1, max_len)
        out.append(text[i:i + n])
        i += n
    return out


WEATHER = invoke("get_weather", ("city", "true", "Paris"), ("days", "false", "3"))
CASES = {
    "plain": ("Hello there.\n", "Hello there.\n", "", []),
    "text_then_call": ("Checking." + block(WEATHER), "Checking.", "",
                       [("get_weather", '{"city": "Paris", "days": 3}', True)]),
    "call_only": (block(WEATHER), "", "", [("get_weather", '{"city": "Paris", "days": 3}', True)]),
    "two_calls": (block(WEATHER, invoke("add", ("a", "false", "1"), ("b", "false", "2.5"))), "", "",
                  [("get_weather", '{"city": "Paris", "days": 3}', True), ("add", '{"a": 1, "b": 2.5}', True)]),
    "no_params": (block(invoke("now")), "", "", [("now", "{}", True)]),
    "json_values": (block(invoke("f", ("o", "false", '{"n": [1,2], "s": "é"}'), ("t", "false", "true"),
                                 ("z", "false", "null"))), "", "",
                    [("f", '{"o": {"n": [1, 2], "s": "é"}, "t": true, "z": null}', True)]),
    "string_needs_escaping": (block(invoke("f", ("q", "true", 'a "b" \\ c\n<d> & é\t'))), "", "",
                              [("f", json.dumps({"q": 'a "b" \\ c\n<d> & é\t'}, ensure_ascii=False), True)]),
    "string_holding_other_tags": (block(invoke("f", ("q", "true", f"</{D}invoke> <{D}parameter x"))), "", "",
                                  [("f", json.dumps({"q": f"</{D}invoke> <{D}parameter x"}, ensure_ascii=False),
                                    True)]),
    "nan_is_not_json": (block(invoke("f", ("x", "false", "NaN"), ("y", "false", "-Infinity"))), "", "",
                        [("f", '{"x": "NaN", "y": "-Infinity"}', True)]),
    "malformed_json_value_becomes_string": (block(invoke("add", ("a", "false", "{1,"), ("b", "false", "2"))), "", "",
                                            [("add", '{"a": "{1,", "b": 2}', True)]),
    "missing_string_attribute": (f'\n\n<{D}tool_calls>\n<{D}invoke name="f">\n<{D}parameter name="a">5</{D}parameter>\n'
                                 f'<{D}parameter name="b">five</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>', "", "",
                                 [("f", '{"a": 5, "b": "five"}', True)]),
    "unknown_tool_passes_through": (block(invoke("nope", ("q", "true", "v"))), "", "", [("nope", '{"q": "v"}', True)]),
    "text_after_block_dropped": (block(WEATHER) + "\nDone!", "", "",
                                 [("get_weather", '{"city": "Paris", "days": 3}', True)]),
    "variant_opener": (f"\n\n<{D}toolcalls>\n{invoke('f')}\n</{D}toolcalls>", "", "", [("f", "{}", True)]),
    "bare_invoke": (f"\n{invoke('f', ('a', 'false', '1'))}\n</{D}tool_calls>", "", "", [("f", '{"a": 1}', True)]),
    "missing_invoke_close": (f'\n\n<{D}tool_calls>\n<{D}invoke name="f">\n</{D}tool_calls>', "", "",
                             [("f", "{}", True)]),
    "lone_angle_brackets": ("if a < b and c <= d then <x> <", "if a < b and c <= d then <x> <", "", []),
    "dsml_word_in_text": (f"the <{D} marker", f"the <{D} marker", "", []),
    "think_block_in_answer": ("<think>hmm</think>Answer.", "Answer.", "hmm", []),
    "stray_think_end_dropped": ("</think>Answer.", "Answer.", "", []),
    "unicode": ("答案是" + block(invoke("get_weather", ("city", "true", "杭州"))), "答案是", "",
                [("get_weather", '{"city": "杭州"}', True)]),
    "inner_whitespace_kept": ("a\n\nb  " + block(invoke("f")), "a\n\nb", "", [("f", "{}", True)]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_whole_output(name):
    text, content, reasoning, calls = CASES[name]
    assert run(text) == (content, reasoning, calls)


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("seed, max_len", [(0, 1), (1, 2), (2, 5), (3, 17)])
def test_random_chunks_same_as_whole(name, seed, max_len):
    text = CASES[name][0]
    assert run(text, random_chunks(text, seed, max_len)) == run(text)


def test_think_markup_is_content_without_reasoning_parser():
    assert run("<think>x</think>y", parse_think=False)[:2] == ("<think>x</think>y", "")


FULL = "Let me check." + block(WEATHER, invoke("add", ("a", "false", "[1, 2]"), ("b", "true", "x y")))


@pytest.mark.parametrize("cut", range(len(FULL) + 1))
def test_cut_off_anywhere_is_well_formed(cut):
    """max_tokens can stop the model anywhere: no markup in content, arguments always valid JSON, calls
    before the cut unchanged, the same result at any chunking."""
    full_content, _, full_calls = run(FULL)
    prefix = FULL[:cut]
    content, reasoning, calls = run(prefix)
    assert run(prefix, random_chunks(prefix, cut, 4)) == (content, reasoning, calls)
    assert D not in content and "<｜" not in content
    assert full_content.startswith(content.rstrip())
    for (name, args, complete), (full_name, full_args, _) in zip(calls, full_calls):
        assert name == full_name and isinstance(json.loads(args), dict)
        if complete:
            assert args == full_args
    assert len(calls) <= len(full_calls)


@pytest.mark.parametrize("prefix, expect", [
    (f"Let me check.\n\n<{D}tool_c", ("Let me check.", [])),
    (f'Ok\n\n<{D}tool_calls>\n<{D}invoke name="get_wea', ("Ok", [])),
    (f'<{D}tool_calls>\n<{D}invoke name="get_weather">\n<{D}parameter name="city" string="true">Par',
     ("", [("get_weather", '{"city": "Par"}', False)])),
    (f'<{D}tool_calls>\n<{D}invoke name="get_weather">\n<{D}parameter name="city" string="true">Paris</{D}para',
     ("", [("get_weather", '{"city": "Paris"}', False)])),
    (f'<{D}tool_calls>\n<{D}invoke name="f">\n<{D}parameter name="n" string="false">[1, 2',
     ("", [("f", "{}", False)])),
    (f'<{D}tool_calls>\n<{D}invoke name="f">\n<{D}parameter name="a" string="false">1</{D}parameter>\n<{D}param',
     ("", [("f", '{"a": 1}', False)])),
])
def test_cut_off_examples(prefix, expect):
    content, _, calls = run(prefix)
    assert (content, calls) == expect


FRAGMENTS = [f"<{D}tool_calls>", f"</{D}tool_calls>", f'<{D}invoke name="', f"</{D}invoke>", f"<{D}parameter",
             f"</{D}parameter>", ' name="k"', ' string="true"', ' string="false"', '"', ">", "<", "\n", "\n\n", " ",
             "f", "1", "{", "}", "[", "é", "<think>", "</think>", D, "</", "NaN", "\\"]


@pytest.mark.parametrize("seed", range(300))
def test_random_markup_never_breaks(seed):
    """Any mix of tags and text (the model can write anything): no exception, JSON arguments, no markup in
    content, the same result at any chunking."""
    rng = random.Random(seed)
    text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 60)))
    whole = run(text)
    assert run(text, random_chunks(text, seed, 6)) == whole
    content, _, calls = whole
    assert f"<{D}tool" not in content and f"<{D}invoke" not in content
    for _, args, _ in calls:
        assert isinstance(json.loads(args), dict)
