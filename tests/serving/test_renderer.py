"""serving/renderer.py: history tool-call arguments vLLM's message parsing cannot take are refused first
(the server's answer, a 400, is checked in test_server.py's bad requests)."""

import pytest

from vllm_dsv4.serving.renderer import refuse_deep_arguments


def history(arguments) -> list[dict]:
    return [{"role": "user", "content": "x"},
            {"role": "assistant", "tool_calls": [{"id": "a", "type": "function",
                                                  "function": {"name": "f", "arguments": arguments}}]}]


@pytest.mark.parametrize("arguments", ["[" * 65 + "]" * 65, '{"a": ' + "[" * 100_000, "{" * 70])
def test_arguments_nested_too_deeply_are_refused_naming_the_message(arguments):
    with pytest.raises(ValueError, match=r"messages\[1\]: tool call arguments nest deeper than 64 levels"):
        refuse_deep_arguments(history(arguments))


@pytest.mark.parametrize("arguments", ["[" * 64 + "]" * 64, '{"a": "' + "[" * 1000 + '"}', "not json", {"a": 1}, None])
def test_other_arguments_pass(arguments):
    refuse_deep_arguments(history(arguments))
    refuse_deep_arguments([{"role": "assistant", "tool_calls": "odd"}, {"role": "user", "content": None}, "odd"])
