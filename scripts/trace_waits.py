"""Where a profiled step waits on the host. Reads a torch-profiler trace (``bench_gpu.py --profile``
writes the decode steps' and the prefill's, gzipped) and prints how long the GPU sat idle between its
kernels and copies, the longest of those gaps with the frame of our code that launched the work ending
each, and every synchronising host call counted and timed by the innermost frame of our code that made
it. With ``--frames N``, also the N Python frames (anyone's code) that held the host longest, with
their own time beside: where a host-bound step spends it.

    python scripts/trace_waits.py bench.plugin.prefill.trace.json.gz [--match REGEX] [--gaps 10] [--frames 25]
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import re
from collections import defaultdict
from pathlib import Path

SYNCS = r"cudaStreamSynchronize|cudaDeviceSynchronize|cudaEventSynchronize"
OUR_CODE = ("vllm_dsv4/", "csrc_triton/")
GPU_WORK = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_API = ("cuda_runtime", "cuda_driver")


def load(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


class Frames:
    """The Python frames of our code per thread, to name the innermost one open at a time."""

    def __init__(self, events: list[dict]):
        self.by_tid: dict[int, list[tuple[float, float, str]]] = defaultdict(list)
        for e in events:
            if e.get("cat") == "python_function" and any(p in e["name"] for p in OUR_CODE):
                self.by_tid[e["tid"]].append((e["ts"], e["ts"] + e.get("dur", 0), e["name"]))
        for frames in self.by_tid.values():
            frames.sort()

    def at(self, tid: int, ts: float) -> str:
        frames = self.by_tid.get(tid, [])
        inner = None
        for start, end, name in frames[: bisect.bisect_right(frames, (ts, float("inf"), ""))]:
            if start <= ts <= end and (inner is None or start >= inner[0]):
                inner = (start, name)
        return inner[1] if inner else "(outside our code)"


def gpu_idle(events: list[dict]) -> tuple[float, float, list[tuple[float, dict]]]:
    """(busy us, span us, gaps as (us, the GPU event ending the gap), longest first) of the GPU work."""
    work = sorted((e for e in events if e.get("cat") in GPU_WORK), key=lambda e: e["ts"])
    busy, gaps, end = 0.0, [], None
    for e in work:
        start, stop = e["ts"], e["ts"] + e.get("dur", 0)
        if end is not None and start > end:
            gaps.append((start - end, e))
        busy += max(0.0, stop - max(start, end if end is not None else start))
        end = stop if end is None else max(end, stop)
    span = (end - work[0]["ts"]) if work else 0.0
    return busy, span, sorted(gaps, key=lambda g: -g[0])


def host_frames(events: list[dict]) -> list[tuple[str, int, float, float]]:
    """``(frame, calls, total us, own us)`` per Python frame name, the most total time first; own time
    leaves out the frames nested in it (on its thread), total time counts a recursive frame once."""
    by_tid: dict[int, list[dict]] = defaultdict(list)
    for e in events:
        if e.get("cat") == "python_function":
            by_tid[e["tid"]].append(e)
    calls: dict[str, int] = defaultdict(int)
    total: dict[str, float] = defaultdict(float)
    own: dict[str, float] = defaultdict(float)
    for frames in by_tid.values():
        frames.sort(key=lambda e: (e["ts"], -e.get("dur", 0)))
        open_frames: list[tuple[float, str]] = []  # (end, name), innermost last
        for e in frames:
            start, dur, name = e["ts"], e.get("dur", 0), e["name"]
            while open_frames and open_frames[-1][0] <= start:
                open_frames.pop()
            if open_frames:
                own[open_frames[-1][1]] -= dur
            calls[name] += 1
            own[name] += dur
            if all(name != outer for _, outer in open_frames):
                total[name] += dur
            open_frames.append((start + dur, name))
    return sorted(((n, calls[n], total[n], own[n]) for n in calls), key=lambda r: -r[2])


def report(events: list[dict], match: str = SYNCS, num_gaps: int = 10, num_frames: int = 0) -> str:
    frames = Frames(events)
    lines = []
    busy, span, gaps = gpu_idle(events)
    if span:
        lines.append(f"GPU: {busy / 1e3:.1f} ms busy over {span / 1e3:.1f} ms, {(span - busy) / 1e3:.1f} ms idle "
                     f"in {len(gaps)} gaps")
        launches = {e["args"].get("correlation"): e for e in events  # Triton launches through the driver API
                    if e.get("cat") in HOST_API and "correlation" in e.get("args", {})}
        for gap, e in gaps[:num_gaps]:
            launch = launches.get(e.get("args", {}).get("correlation"))
            where = frames.at(launch["tid"], launch["ts"]) if launch else "(launch not in the trace)"
            lines.append(f"  {gap / 1e3:8.3f} ms before {e['name'][:60]}  <- {where}")
    pattern = re.compile(match)
    calls: dict[tuple[str, str], list[float]] = defaultdict(list)
    for e in events:
        if e.get("cat") in HOST_API + ("cpu_op",) and pattern.search(e["name"]):
            calls[(e["name"], frames.at(e["tid"], e["ts"]))].append(e.get("dur", 0))
    lines.append(f"host calls matching {match!r}: {sum(len(v) for v in calls.values())}")
    for (name, where), durs in sorted(calls.items(), key=lambda kv: -sum(kv[1])):
        lines.append(f"  {len(durs):5d} x {name[:40]:40s} {sum(durs) / 1e3:9.3f} ms  {where}")
    if num_frames:
        lines.append("host frames, the most time first (total ms, own ms, calls):")
        for name, count, total, own in host_frames(events)[:num_frames]:
            lines.append(f"  {total / 1e3:9.3f} {own / 1e3:9.3f} {count:6d}  {name[:110]}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace", type=Path)
    ap.add_argument("--match", default=SYNCS, help="regex of the host calls to attribute")
    ap.add_argument("--gaps", type=int, default=10, help="how many of the longest GPU gaps to list")
    ap.add_argument("--frames", type=int, default=0, help="how many of the longest-held Python frames to list")
    args = ap.parse_args()
    print(report(load(args.trace), args.match, args.gaps, args.frames))


if __name__ == "__main__":
    main()
