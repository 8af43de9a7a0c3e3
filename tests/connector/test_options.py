"""DSV4Connector's kv_connector_extra_config: parsed, and refused naming what is wrong."""

import re

import pytest

from vllm_dsv4.config import ConfigError
from vllm_dsv4.connector.options import Options


def test_options_parse(tmp_path):
    assert Options.parse({"path": "/x", "max_bytes": "64e9", "window_every": 4096}) == Options("/x", 64 * 10**9, 4096)
    assert Options.parse({"path": "/x"}) == Options("/x")
    (tmp_path / "secret").write_text("0123456789abcdef0123\n")
    assert Options.parse({"path": "/x", "secret_file": str(tmp_path / "secret"), "group": "0", "pin_loads": True,
                          "lookup_timeout_s": 0.5}) == Options("/x", secret=b"0123456789abcdef0123", group=0,
                                                                pin_loads=True, lookup_timeout_s=0.5)


@pytest.mark.parametrize("extra, words", [
    ({}, "'path' required"),
    ({"path": "/x", "max_byte": 1}, "unknown: ['max_byte']"),
    ({"path": "/x", "max_bytes": "lots"}, "are numbers"),
    ({"path": "/x", "lookup_timeout_s": 0}, "must be > 0"),
    ({"path": "/x", "pin_loads": "yes"}, "pin_loads is true or false"),
    ({"path": "/x", "secret": "short"}, "at least 16 bytes"),
    ({"path": "/x", "secret": "s" * 16, "secret_file": "/f"}, "not both"),
    ({"path": "/x", "secret_file": "/nonexistent/secret"}, "cannot read secret_file"),
    ({"path": "/x", "group": "no-such-group-here"}, "no group"),
    ({"path": "/x", "window_every": 0}, "must be > 0"),
])
def test_bad_options_are_named(extra, words):
    with pytest.raises(ConfigError, match=re.escape(words)):
        Options.parse(extra)
