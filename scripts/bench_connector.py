"""Prefill/decode hand-off on this machine: NIXL (``DSV4NixlConnector``) against the ``DSV4Connector``
store against recomputing the prompt. A benchmark, not a test.

    .venv/bin/python scripts/bench_connector.py [--ckpt DIR] [--lens 1024 4096 8192] [--repeat 3] [--serve ARGS]

Two OpenAI servers on 127.0.0.1, each with one ``--kv-transfer-config``: a prefill server
(``MultiConnector``: NIXL producer + store producer) and a decode server (NIXL consumer + store consumer,
local prefix caching off, so a prompt it has seen comes from a connector or is computed). For each
length, medians over ``--repeat`` fresh prompts, each request one output token (its time is its time to
first token, through HTTP):
- *recompute*: the decode server given a prompt nobody saved;
- *prefill*: the prefill server (it writes the store's entries and keeps its blocks for NIXL);
- *NIXL*: the decode server handed that prompt's ``kv_transfer_params`` (vLLM's proxy protocol);
- *store*: the decode server given the same prompt again, without them (it resumes from the store).
A disaggregated request's first token takes *prefill* + *NIXL* (or + *store*). Bytes per prompt token:
what NIXL reported moving (its telemetry) and what the store gained, with the bytes per component
NIXL moves at most according to ``kv/layout.py`` and vLLM's NIXL scheduler (the window groups' bound),
for this checkpoint (beside NIXL's count) and for V4-Flash.
"""

import argparse
import json
import os
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).parent))
import kv_handoff  # noqa: E402
from make_checkpoint import make_checkpoint, make_config  # noqa: E402

from vllm_dsv4.config import Dsv4Config  # noqa: E402
from vllm_dsv4.kv.layout import layer_components  # noqa: E402

COMPRESSED_BLOCK_TOKENS = 256  # the plugin's KV-cache block (patches.py)


def nixl_bytes(cfg: Dsv4Config, kv_dtype: torch.dtype, fp8: bool, prompt: int) -> dict[str, int]:
    """Bytes NIXL moves per component for one prompt, at most: every block of a full-history group, and
    of a window group the last ``cdiv(window, block) + 1`` blocks (vLLM's scheduler clips those groups
    to no more; it may hand over fewer, a fixed amount per request)."""
    moved: dict[str, int] = {}
    for layer in range(cfg.num_hidden_layers):
        for name, comp in layer_components(cfg, cfg.layer_kind(layer), kv_dtype, COMPRESSED_BLOCK_TOKENS, fp8).items():
            blocks = -(-prompt // comp.block_tokens)
            if comp.window_tokens is not None:
                blocks = min(blocks, -(-comp.window_tokens // comp.block_tokens) + 1)
            moved[name] = moved.get(name, 0) + blocks * comp.page_bytes
    return moved


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(2, 1000, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(ckpt: Path, kv: dict, max_len: int, log: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    # the tiny checkpoint has 4,096 positions; the benchmark times prompts, it does not read outputs
    env = dict(os.environ, VLLM_PLUGINS="vllm_dsv4", VLLM_NIXL_SIDE_CHANNEL_PORT=str(free_port()),
               VLLM_ALLOW_LONG_MAX_MODEL_LEN="1")
    if not torch.cuda.is_available():
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(ckpt), "--enforce-eager",
           "--max-model-len", str(max_len), "--served-model-name", "m", "--host", "127.0.0.1", "--port", str(port),
           "--kv-transfer-config", json.dumps(kv), *extra]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"the server exited:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(1)
    sys.exit(f"the server did not start:\n{log.read_text()[-4000:]}")


def timed(base: str, body: dict) -> tuple[float, dict]:
    start = time.perf_counter()
    answer = httpx.post(base + "/v1/completions", json=body, timeout=900)
    seconds = time.perf_counter() - start
    if answer.status_code != 200:
        sys.exit(f"{base} answered {answer.status_code}: {answer.text[:2000]}")
    return seconds, answer.json()


def metric(base: str, name: str, label: str = "") -> float:
    text = httpx.get(base + "/metrics", timeout=30).text
    samples = re.findall(rf"^{re.escape(name)}(?:{{([^}}]*)}})? (\S+)$", text, re.M)
    return sum(float(value) for labels, value in samples if label in labels)


def store_bytes(store: Path) -> int:
    return sum(p.stat().st_size for p in store.rglob("*.kv"))


def measure(args, prefill: str, decode: str) -> dict:
    request = {"model": "m", "max_tokens": 1, "temperature": 0, "ignore_eos": True}
    loaded = 'source="external_kv_transfer"'
    rows = {}
    for length in args.lens:
        samples = {key: [] for key in ("recompute", "prefill", "nixl", "store", "nixl_bytes", "store_bytes")}
        for repeat in range(args.repeat):
            fresh, handed = prompt(length, 2 * (length + 1000 * repeat)), prompt(length, 2 * (length + 1000 * repeat) + 1)
            samples["recompute"].append(timed(decode, dict(request, prompt=fresh))[0])
            stored = store_bytes(args.store)
            seconds, answer = timed(prefill, kv_handoff.prefill_request(dict(request, prompt=handed)))
            samples["prefill"].append(seconds)
            samples["store_bytes"].append(store_bytes(args.store) - stored)
            moved, took = metric(decode, "vllm:nixl_bytes_transferred_sum"), metric(decode, "vllm:prompt_tokens_by_source_total", loaded)
            samples["nixl"].append(timed(decode, kv_handoff.decode_request(dict(request, prompt=handed), json.dumps(answer)))[0])
            samples["nixl_bytes"].append(metric(decode, "vllm:nixl_bytes_transferred_sum") - moved)
            assert metric(decode, "vllm:prompt_tokens_by_source_total", loaded) - took == length, "NIXL did not load it"
            took = metric(decode, "vllm:prompt_tokens_by_source_total", loaded)
            samples["store"].append(timed(decode, dict(request, prompt=handed))[0])
            assert metric(decode, "vllm:prompt_tokens_by_source_total", loaded) - took == length - 1, "not from the store"
        rows[length] = {key: statistics.median(values) for key, values in samples.items()}
    return rows


def component_table(title: str, cfg: Dsv4Config, kv_dtype: torch.dtype, fp8: bool, lens: list[int]) -> str:
    per = {n: nixl_bytes(cfg, kv_dtype, fp8, n) for n in lens}
    lines = [f"**{title}**: at most the bytes NIXL moves per prompt token, by component", "",
             "| component | " + " | ".join(f"{n:,} tokens" for n in lens) + " |", "|---|" + "---|" * len(lens)]
    for name in per[lens[0]]:
        lines.append(f"| `{name}` | " + " | ".join(f"{per[n][name] / n:,.1f}" for n in lens) + " |")
    lines.append("| all | " + " | ".join(f"{sum(per[n].values()) / n:,.1f}" for n in lens) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", help="checkpoint folder (default: a fresh tiny one)")
    ap.add_argument("--store", help="the store's folder (default: a fresh one under /dev/shm)")
    ap.add_argument("--lens", type=int, nargs="+", default=[1024, 4096, 8192])
    ap.add_argument("--repeat", type=int, default=3, help="medians over this many fresh prompts")
    ap.add_argument("--serve", default="--dtype float32",
                    help="more server flags, e.g. on one GPU: '--kv-cache-dtype fp8 --gpu-memory-utilization 0.4'")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench_connector_"))
    args.ckpt = Path(args.ckpt) if args.ckpt else make_checkpoint(work / "tiny", "tiny", seed=0)
    args.store = Path(args.store) if args.store else Path(tempfile.mkdtemp(dir="/dev/shm"))
    store = {"kv_connector": "DSV4Connector", "kv_connector_extra_config": {"path": str(args.store)}}

    def both(role: str) -> dict:
        return {"kv_connector": "MultiConnector", "kv_role": role, "kv_connector_extra_config": {"connectors": [
            {"kv_connector": "DSV4NixlConnector", "kv_role": role}, dict(store, kv_role=role)]}}

    max_len = max(args.lens) + 16
    servers = []
    try:
        serve = shlex.split(args.serve)
        servers.append(start_server(args.ckpt, both("kv_producer"), max_len, work / "prefill.log", *serve))
        servers.append(start_server(args.ckpt, both("kv_consumer"), max_len, work / "decode.log", *serve,
                                    "--no-enable-prefix-caching"))
        rows = measure(args, servers[0][1], servers[1][1])
    finally:
        for proc, _ in servers:
            os.killpg(proc.pid, signal.SIGTERM)
    cfg = Dsv4Config.from_dict(json.loads((args.ckpt / "config.json").read_text()))
    served = dict(zip(serve, serve[1:]))  # flag -> value
    fp8 = served.get("--kv-cache-dtype", "auto").startswith("fp8")
    kv_dtype = getattr(torch, served.get("--dtype", "bfloat16"))
    print(f"{args.ckpt}, {args.serve}, decode server's medians of {args.repeat}; store {args.store}\n")
    print("| prompt tokens | recompute (s) | prefill (s) | NIXL hand-off (s) | store hand-off (s) "
          "| NIXL B/token | layout's bound, NIXL B/token | store B/token |")
    print("|---|---|---|---|---|---|---|---|")
    for n, r in rows.items():
        predicted = sum(nixl_bytes(cfg, kv_dtype, fp8, n).values()) / n
        print(f"| {n:,} | {r['recompute']:.3f} | {r['prefill']:.3f} | {r['nixl']:.3f} | {r['store']:.3f} "
              f"| {r['nixl_bytes'] / n:,.1f} | {predicted:,.1f} | {r['store_bytes'] / n:,.1f} |")
    print()
    print(component_table(f"This checkpoint, {'FP8' if fp8 else kv_dtype} KV", cfg, kv_dtype, fp8, args.lens))
    print()
    flash = Dsv4Config.from_dict(make_config("flash", num_layers=43))
    print(component_table("V4-Flash (43 layers), FP8 KV", flash, torch.bfloat16, True, args.lens + [65536]))


if __name__ == "__main__":
    main()
