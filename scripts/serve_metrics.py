"""scripts/bench_serve.sh's helpers: a server's queue while a level runs, and the results table.

    python scripts/serve_metrics.py poll --port 8123 --out level.metrics.json   # until SIGTERM
    python scripts/serve_metrics.py report --model CKPT --dir serve-logs [--card h200]

``poll`` reads the server's Prometheus ``/metrics`` every 0.2 s and, when stopped, writes the most
requests it saw waiting and running, the peak KV-cache usage and the preemptions during the level.
``report`` prints one row per shape and concurrency level with both engines side by side (output tok/s,
TTFT and TPOT median / p99, the most requests waiting) and the floors of scripts/floors.py beside them:
TPOT's is a decode step's HBM floor at that batch (the context half-way through the outputs), TTFT's at
concurrency 1 the prompt's tensor-core floor.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GAUGES = {"waiting": "vllm:num_requests_waiting", "running": "vllm:num_requests_running",
          "kv_usage": "vllm:kv_cache_usage_perc", "preemptions": "vllm:num_preemptions_total"}
ENGINES = ("plugin", "intree")


def read_metrics(text: str) -> dict[str, float]:
    """Prometheus exposition text -> the GAUGES' values (summed over label sets)."""
    values = dict.fromkeys(GAUGES, 0.0)
    for line in text.splitlines():
        for key, name in GAUGES.items():
            if line.startswith(name + "{") or line.startswith(name + " "):
                values[key] += float(line.rsplit(" ", 1)[1])
    return values


def poll(port: int, out: Path, every: float = 0.2) -> None:
    url, seen, first = f"http://127.0.0.1:{port}/metrics", {}, None
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    while not stop:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                now = read_metrics(r.read().decode())
        except OSError:
            now = None
        if now:
            first = first or now
            for key in ("waiting", "running", "kv_usage"):
                seen[f"max_{key}"] = max(seen.get(f"max_{key}", 0.0), now[key])
            seen["preemptions"] = now["preemptions"] - first["preemptions"]
        time.sleep(every)
    out.write_text(json.dumps(seen))


def _results(folder: Path) -> dict[tuple[int, int, int], dict[str, dict]]:
    """(input, output, concurrency) -> engine -> the bench's result with the poller's figures."""
    rows: dict = {}
    for path in folder.glob("*.c*.json"):
        m = re.fullmatch(r"(\w+)\.(\d+)-(\d+)\.c(\d+)\.json", path.name)
        if not m:
            continue
        engine, shape = m.group(1), tuple(int(v) for v in m.group(2, 3, 4))
        result = json.loads(path.read_text())
        queue = path.with_suffix(".metrics.json")
        result.update(json.loads(queue.read_text()) if queue.exists() else {})
        rows.setdefault(shape, {})[engine] = result
    return rows


def report(model: str, folder: Path, card: str) -> str:
    from scripts.floors import CARDS, Card, decode_bytes, prefill_flops
    from vllm_dsv4.config import Dsv4Config

    cfg, hw = Dsv4Config.from_pretrained(model), Card(*CARDS[card])
    lines = [f"Serving ({card}): per engine output tok/s, TTFT median / p99 (ms), TPOT median / p99 (ms), the most "
             "requests waiting; floors from scripts/floors.py",
             "| in / out | concurrency | engine | output tok/s | TTFT | TPOT | waiting | TPOT floor | TTFT floor |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for (inp, out, conc), engines in sorted(_results(folder).items()):
        tpot_floor = sum(decode_bytes(cfg, conc, inp + out // 2).values()) / hw.bandwidth * 1e3
        prefill = prefill_flops(cfg, inp)
        fp8 = prefill["fp8_linears"] + prefill["indexer"]
        ttft_floor = (fp8 / hw.fp8_flops + (sum(prefill.values()) - fp8) / hw.bf16_flops) * 1e3
        for engine in ENGINES:
            r = engines.get(engine)
            if r is None:
                continue
            waiting = f"{r['max_waiting']:.0f}" if "max_waiting" in r else "-"
            ttft = f"{r['median_ttft_ms']:.0f} / {r['p99_ttft_ms']:.0f}"
            tpot = f"{r['median_tpot_ms']:.2f} / {r['p99_tpot_ms']:.2f}"
            lines.append(f"| {inp} / {out} | {conc} | {engine} | {r['output_throughput']:,.0f} | {ttft} | {tpot} "
                         f"| {waiting} | {tpot_floor:.2f} | {ttft_floor if conc == 1 else float('nan'):.1f} |")
    return "\n".join(lines).replace("| nan |", "| - |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("poll")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--out", type=Path, required=True)
    r = sub.add_parser("report")
    r.add_argument("--model", required=True)
    r.add_argument("--dir", type=Path, required=True)
    r.add_argument("--card", default="h200")
    args = ap.parse_args()
    if args.cmd == "poll":
        poll(args.port, args.out)
    else:
        print(report(args.model, args.dir, args.card))
    return 0


if __name__ == "__main__":
    sys.exit(main())
