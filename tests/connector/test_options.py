"""DSV4Connector's kv_connector_extra_config: parsed, and refused naming what is wrong."""

import re

import pytest

from vllm_dsv4.config import ConfigError
from vllm_dsv4.connector.connector import Options


def test_options_parse():
    assert Options.parse({"path": "/x", "max_bytes": "64e9", "window_every": 4096}) == Options("/x", 64 * 10**9, 4096)
    assert Options.parse({"path": "/x"}) == Options("/x")


@pytest.mark.parametrize("extra, words", [
    ({}, "'path' required"),
    ({"path": "/x", "max_byte": 1}, "unknown: ['max_byte']"),
    ({"path": "/x", "max_bytes": "lots"}, "are numbers"),
    ({"path": "/x", "window_every": 0}, "must be > 0"),
])
def test_bad_options_are_named(extra, words):
    with pytest.raises(ConfigError, match=re.escape(words)):
        Options.parse(extra)
