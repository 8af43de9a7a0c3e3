"""What `lint-imports` (pyproject.toml's contracts: modules) cannot see: names. No module of the
plugin or of csrc_triton takes another module's private name (``_x``); a name shared between modules
is public in its one home (csrc_triton/codec.py, formats.py, ...)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("vllm_dsv4", "csrc_triton")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_names_taken(path: Path) -> list[str]:
    """``module.name`` of each private name of another of our modules that ``path`` imports or reads
    as an attribute of a module it imported."""
    tree = ast.parse(path.read_text(), str(path))
    found, modules = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PACKAGES:
            for alias in node.names:
                if _private(alias.name):
                    found.append(f"{node.module}.{alias.name}")
                else:  # maybe a module: `from csrc_triton import kv_cache`
                    modules[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in PACKAGES and alias.asname:
                    modules[alias.asname] = alias.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules \
                and _private(node.attr):
            found.append(f"{modules[node.value.id]}.{node.attr}")
    return found


def test_no_module_takes_another_modules_private_names():
    taken = {str(p.relative_to(ROOT)): names for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))
             if (names := private_names_taken(p))}
    assert taken == {}
