"""What a CUDA graph's launch costs the host, per node, by kind of node: is the decode step's
``cudaGraphLaunch`` (several times the in-tree engine's, per step) set by how many nodes the graph holds
or by what they are?

    python scripts/bench_graph_launch.py [--nodes 350] [--replays 50]

Each case captures ``--nodes`` launches of one kind into a graph over a 4 KiB buffer (so the GPU's
share is small and alike) and replays it with the GPU idle (synchronised before each replay): the
host time of ``replay()`` alone, and the GPU time per replay. Kinds: torch's elementwise kernel, a
Triton kernel with 3 arguments, one with 24 (our kernels take 10-30), device-to-device copies
(memcpy nodes) and memsets. A benchmark, not a test (it needs a GPU).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import triton
import triton.language as tl


@triton.jit
def _add_one(x_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + 1, mask=i < n)


@triton.jit
def _add_one_many_args(x_ptr, p1, p2, p3, p4, p5, p6, p7, n, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11,
                       s12, s13, s14, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + 1, mask=i < n)


def cases(x: torch.Tensor, other: torch.Tensor) -> dict:
    n = x.numel()
    pointers = [torch.empty(16, device=x.device) for _ in range(7)]
    return {
        "torch add_": lambda: x.add_(1),
        "triton, 3 args": lambda: _add_one[(1,)](x, n, BLOCK=1024),
        "triton, 24 args": lambda: _add_one_many_args[(1,)](x, *pointers, n, *range(1, 15), BLOCK=1024),
        "copy (memcpy node)": lambda: other.copy_(x),
        "zero_ (memset node)": lambda: x.zero_(),
    }


def measure(launch, nodes: int, replays: int) -> tuple[float, float]:
    """(median host us per replay() call, median GPU us per replay) of a graph of ``nodes`` launches."""
    for _ in range(2):  # compile and warm outside the capture
        launch()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(nodes):
            launch()
    graph.replay()
    torch.cuda.synchronize()
    host, device = [], []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(replays):
        torch.cuda.synchronize()
        start.record()
        t0 = time.perf_counter()
        graph.replay()
        host.append((time.perf_counter() - t0) * 1e6)
        end.record()
        end.synchronize()
        device.append(start.elapsed_time(end) * 1e3)
    return statistics.median(host), statistics.median(device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=350, help="launches per graph (a 6-layer decode step's: 349)")
    ap.add_argument("--replays", type=int, default=50)
    args = ap.parse_args()
    x = torch.zeros(1024, device="cuda")
    other = torch.empty_like(x)
    print(f"{torch.cuda.get_device_name()}, {args.nodes} nodes per graph, median of {args.replays} replays")
    print(f"{'node kind':22s} {'host us / replay':>17s} {'host us / node':>15s} {'GPU us / replay':>16s}")
    for name, launch in cases(x, other).items():
        host, device = measure(launch, args.nodes, args.replays)
        print(f"{name:22s} {host:17.1f} {host / args.nodes:15.3f} {device:16.1f}")


if __name__ == "__main__":
    main()
