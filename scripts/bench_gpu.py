"""Our plugin against vLLM's in-tree DeepSeek-V4 on one checkpoint, one GPU (a benchmark, not a test).

    python scripts/bench_gpu.py --model CKPT                       # both engines, then the table
    python scripts/bench_gpu.py --model CKPT --engines intree --out intree.json   # one engine per call
    python scripts/bench_gpu.py --report plugin.json intree.json   # the table from saved runs

Each engine runs in its own process (vLLM keeps process-global state; the in-tree one needs our
plugin disabled through ``VLLM_PLUGINS``). Measured per engine, after warming every shape up:
  * first requests: right after the engine is ready, prompts of 777 and 3,001 tokens (2 output
    tokens each, one after the other), then the same lengths again with other tokens: what the
    first users of a fresh engine wait for compiles of kernels (any JIT: Triton, DeepGEMM, TileLang)
    beyond what the same work costs warm;
  * time to ready: ``LLM(...)`` construction, wall clock; with ``--first-start``, each engine is first
    started once in a process of its own that only constructs it (compiling what its kernels and
    vLLM's JIT-compile on a fresh machine, and reading the checkpoint into the page cache), and the
    table shows that first start beside the measured run's, so that neither engine's start-up is
    shortened by caches the other one filled; ``--jit-root DIR`` gives each engine empty JIT caches
    of its own under DIR/<engine> (vLLM's cache root with DeepGEMM's and Inductor's, Triton's,
    TileLang's): its first start is then a cold one, the measured start a warm one;
  * decode output tok/s at batch 1 / 16 / 64: 1k-token prompts, 128 output tokens; the engine is
    stepped by hand and only the steps after every request has its first token are timed (no
    prefill or mixed step counted);
  * prefill tok/s at 8k and 32k tokens (one prompt, 1 output token);
  * KV-cache bytes, token capacity (vLLM's own max concurrency at ``max_model_len`` times
    ``max_model_len``, the same formula for both engines) and bytes per token;
  * with ``--mtp K``, both engines draft K tokens per step with the checkpoint's MTP module; the
    decode rows then include drafting and verifying, and the table adds the drafts' acceptance
    (random-weight checkpoints accept almost none: the rows then price MTP's overhead);
  * with ``--profile``, for 16 decode steps at batch 16 and at batch 1 and an 8k-token prefill: the CUDA kernels
    and the host-side ops that dominate (torch profiler tables, with the steps' wall time), and the
    prefill's trace (Chrome trace format, gzipped) to find where the GPU waits on the host.
vLLM 0.26's in-tree model applies YaRN to window-only layers (fixed in 0.32): compare speed, not outputs.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DECODE_BATCHES = (1, 16, 64)
PREFILL_LENS = (8192, 32768)
PROMPT_LEN, OUTPUT_LEN = 1024, 128
FIRST_REQUEST_LENS = (777, 3001)  # lengths no warm-up step of either engine has

ENGINES = {
    # Decode steps replay full CUDA graphs (our layers are not torch.compiled, so nothing is piecewise).
    "plugin": dict(env={"VLLM_PLUGINS": "vllm_dsv4", "VLLM_DEEP_GEMM_WARMUP": "skip"},
                   engine=dict(kv_cache_dtype="fp8", compilation_config={"cudagraph_mode": "FULL_DECODE_ONLY",
                                                                         "max_cudagraph_capture_size": 64})),
    # The in-tree model only has the fp8_ds_mla cache layout; DeepGEMM warm-up would JIT for ~40 min.
    "intree": dict(env={"VLLM_PLUGINS": "none", "VLLM_DEEP_GEMM_WARMUP": "skip"},
                   engine=dict(kv_cache_dtype="fp8", compilation_config={"max_cudagraph_capture_size": 64})),
}


def prompts(n: int, length: int, seed: int, vocab: int):
    import torch
    from vllm.inputs import TokensPrompt

    g = torch.Generator().manual_seed(seed)
    return [TokensPrompt(prompt_token_ids=torch.randint(10, vocab, (length,), generator=g).tolist()) for _ in range(n)]


def greedy(max_tokens: int):
    """Fresh params per use: LLM.generate makes the params it gets final-output-only."""
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)


def timed_generate(llm, batch, max_tokens: int) -> float:
    llm.generate(batch, greedy(max_tokens), use_tqdm=False)  # warm-up of this shape
    start = time.perf_counter()
    llm.generate(batch, greedy(max_tokens), use_tqdm=False)
    return time.perf_counter() - start


def add_warm(llm, batch, max_tokens: int, tag: str) -> None:
    """A warm-up generation of ``batch``'s shapes, then ``batch`` added to the engine to be stepped by hand."""
    llm.generate(batch, greedy(max_tokens), use_tqdm=False)
    for i, prompt in enumerate(batch):
        llm.llm_engine.add_request(f"{tag}-{i}", prompt, greedy(max_tokens))


def start_decoding(llm, batch, max_tokens: int, tag: str) -> int:
    """``add_warm``, then steps until every request has its first token: what is left are decode
    steps. Returns the tokens produced so far."""
    add_warm(llm, batch, max_tokens, tag)
    engine, produced = llm.llm_engine, {}
    while len(produced) < len(batch) and engine.has_unfinished_requests():
        for out in engine.step():
            if out.outputs and out.outputs[0].token_ids:
                produced[out.request_id] = len(out.outputs[0].token_ids)
    return sum(produced.values())


def decode_tok_s(llm, batch, max_tokens: int) -> float:
    """Output tokens per second of the pure decode steps of ``batch`` (see :func:`start_decoding`)."""
    produced = start_decoding(llm, batch, max_tokens, f"decode-{len(batch)}")
    engine = llm.llm_engine
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return (len(batch) * max_tokens - produced) / (time.perf_counter() - start)


def first_requests_s(llm, vocab: int) -> tuple[float, float]:
    """Seconds to serve ``FIRST_REQUEST_LENS``' prompts one after the other, first right after the
    engine is ready, then again with other tokens (prefix caching is off)."""

    def serve(seed: int) -> float:
        start = time.perf_counter()
        for length in FIRST_REQUEST_LENS:
            llm.generate(prompts(1, length, seed + length, vocab), greedy(2), use_tqdm=False)
        return time.perf_counter() - start

    return serve(1), serve(2)


def kv_capacity(llm) -> dict:
    from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config

    vllm_config = llm.llm_engine.vllm_config
    kv_config = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config
    tensors = kv_config.kv_cache_tensors
    if hasattr(tensors[0], "block_stride"):  # vLLM 0.32: views into one pool, block_stride bytes per block
        total = kv_config.num_blocks * tensors[0].block_stride
    else:  # vLLM 0.26: one allocation per tensor
        total = sum(t.size for t in tensors)
    max_len = vllm_config.model_config.max_model_len
    concurrency = get_max_concurrency_for_kv_cache_config(vllm_config, kv_config)
    tokens = int(concurrency * max_len)
    return dict(kv_cache_gib=total / 2**30, token_capacity=tokens, concurrency_at_max_len=concurrency,
                kv_bytes_per_token=total / max(tokens, 1))


def draft_acceptance(llm) -> float:
    """Accepted over proposed draft tokens so far (vLLM's speculative-decoding counters)."""
    from tests.e2e.run_vllm import spec_decode_counters

    counters = spec_decode_counters(llm)
    return counters["vllm:spec_decode_num_accepted_tokens"] / max(counters["vllm:spec_decode_num_draft_tokens"], 1)


def run_engine(name: str, model: str, max_model_len: int, gpu_memory_utilization: float,
               decode_batches=DECODE_BATCHES, prefill_lens=PREFILL_LENS, profile_path: Path | None = None,
               mtp: int = 0, ready_only: bool = False, first_requests: bool = True) -> dict:
    from vllm import LLM

    drafting = dict(speculative_config={"method": "mtp", "num_speculative_tokens": mtp}, disable_log_stats=False)
    start = time.perf_counter()
    llm = LLM(model=model, skip_tokenizer_init=True, max_model_len=max_model_len, enable_prefix_caching=False,
              gpu_memory_utilization=gpu_memory_utilization, max_num_seqs=max(decode_batches),
              max_num_batched_tokens=8192, seed=0, **ENGINES[name]["engine"], **(drafting if mtp else {}))
    import torch

    result = dict(engine=name, time_to_ready_s=time.perf_counter() - start, **kv_capacity(llm),
                  env={k: v for k, v in sorted(os.environ.items()) if k.startswith("VLLM_DSV4_")},
                  device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
    if ready_only:
        return result
    vocab = llm.llm_engine.model_config.get_vocab_size()
    if first_requests:
        result["first_requests_s"], result["first_requests_again_s"] = first_requests_s(llm, vocab)
        print(f"[{name}] first requests: {result['first_requests_s']:.2f} s, "
              f"again {result['first_requests_again_s']:.2f} s", flush=True)
    for batch_size in decode_batches:
        result[f"decode_tok_s_b{batch_size}"] = decode_tok_s(llm, prompts(batch_size, PROMPT_LEN, batch_size, vocab),
                                                             OUTPUT_LEN)
        print(f"[{name}] decode batch {batch_size}: {result[f'decode_tok_s_b{batch_size}']:.1f} tok/s", flush=True)
    for length in prefill_lens:
        seconds = timed_generate(llm, prompts(1, length, length, vocab), 1)
        result[f"prefill_tok_s_{length}"] = length / seconds
        print(f"[{name}] prefill {length}: {length / seconds:.0f} tok/s", flush=True)
    if mtp:
        result.update(mtp_draft_tokens=mtp, mtp_acceptance=draft_acceptance(llm))
    if profile_path:  # 16 decode steps of 16 requests, and of one; one 8k-token prefill
        profile_steps(llm, prompts(16, PROMPT_LEN, 16, vocab), 17, profile_path.with_suffix(".decode.txt"))
        profile_steps(llm, prompts(1, PROMPT_LEN, 1, vocab), 17, profile_path.with_suffix(".decode1.txt"))
        profile_steps(llm, prompts(1, 8192, 8192, vocab), 1, profile_path.with_suffix(".prefill.txt"))
    return result


def profile_steps(llm, batch, max_tokens: int, path: Path) -> Path:
    """What dominates a step: the engine steps after every request of ``batch`` has its first token
    (decode), or all its steps (prefill, ``max_tokens=1``), profiled; written to ``path``: the steps'
    wall time, the CUDA kernels by their time and the host-side ops by their own CPU time (a host sync
    shows as a long ``cudaStreamSynchronize`` / ``aten::_local_scalar_dense``), with Python frames
    recorded: the trace, gzipped beside it, nests each copy or sync in the frames that made it and
    shows where a host-bound decode step spends its time (``scripts/trace_waits.py --frames``)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda, prefill, engine = torch.cuda.is_available(), max_tokens == 1, llm.llm_engine
    if prefill:
        add_warm(llm, batch, max_tokens, f"profile-{path.stem}")
    else:  # decode: the prefill steps run outside the profile
        start_decoding(llm, batch, max_tokens, f"profile-{path.stem}")
    steps = 0
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []),
                 with_stack=True) as prof:
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        wall = time.perf_counter() - start
    averages = prof.key_averages()
    tables = [averages.table(sort_by="self_cuda_time_total", row_limit=45)] if cuda else []
    tables.append(averages.table(sort_by="self_cpu_time_total", row_limit=30))
    # GPU work items per step (kernels, copies, memsets): a replayed graph's nodes, each of which its
    # launch pays for on the host
    device_events = sum(1 for e in prof.events() if e.device_type.name == "CUDA")
    path.write_text(f"{len(batch)} requests, {steps} engine steps profiled, {wall * 1e3:.1f} ms wall clock "
                    f"(under the profiler), {device_events / max(steps, 1):.0f} GPU kernels / copies / memsets "
                    f"per step\n" + "\n".join(tables))
    trace = path.with_suffix(".trace.json")
    prof.export_chrome_trace(str(trace))
    with trace.open("rb") as raw, gzip.open(f"{trace}.gz", "wb") as packed:
        shutil.copyfileobj(raw, packed)
    trace.unlink()
    print(f"profile -> {path} ({steps} steps)", flush=True)
    return path


def jit_cache_env(root: Path) -> dict[str, str]:
    """Environment that puts every JIT cache an engine fills under ``root``, emptied here: vLLM's cache
    root (DeepGEMM's kernels, torch.compile's artefacts), Inductor's, Triton's and TileLang's."""
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    return dict(VLLM_CACHE_ROOT=str(root), TRITON_CACHE_DIR=str(root / "triton"),
                TORCHINDUCTOR_CACHE_DIR=str(root / "inductor"), TILELANG_CACHE_DIR=str(root / "tilelang"))


def table_rows(keys: set[str]) -> list[tuple[str, str, str, str]]:
    """(key, label, format, which way is better) for the metrics present, in a fixed order."""
    rows = []
    if "time_to_ready_cold_s" in keys:  # --jit-root: the first start had empty JIT caches
        rows += [("time_to_ready_cold_s", "time to ready, cold: empty JIT caches (s)", "{:.1f}", "lower"),
                 ("time_to_ready_s", "time to ready, warm (s)", "{:.1f}", "lower")]
    else:
        if "time_to_ready_first_s" in keys:
            rows.append(("time_to_ready_first_s", "time to ready, first start (s)", "{:.1f}", "lower"))
        rows.append(("time_to_ready_s", "time to ready (s)", "{:.1f}", "lower"))
    if "first_requests_s" in keys:
        rows += [("first_requests_s", "first requests after ready (s)", "{:.2f}", "lower"),
                 ("first_requests_again_s", "the same again (s)", "{:.2f}", "lower")]
    for b in sorted(int(k.rsplit("_b", 1)[1]) for k in keys if k.startswith("decode_tok_s_b")):
        rows.append((f"decode_tok_s_b{b}", f"decode tok/s, batch {b}", "{:.1f}", "higher"))
    for n in sorted(int(k.rsplit("_", 1)[1]) for k in keys if k.startswith("prefill_tok_s_")):
        rows.append((f"prefill_tok_s_{n}", f"prefill tok/s, {n} tokens", "{:.0f}", "higher"))
    rows += [("kv_cache_gib", "KV cache (GiB)", "{:.2f}", "-"), ("token_capacity", "token capacity", "{:,}", "higher"),
             ("kv_bytes_per_token", "KV bytes / token", "{:.1f}", "lower")]
    if "mtp_acceptance" in keys:
        rows += [("mtp_draft_tokens", "MTP draft tokens per step", "{}", "-"),
                 ("mtp_acceptance", "MTP draft acceptance", "{:.3f}", "-")]
    return rows


def floor_cells(results: dict[str, dict], model: str | None) -> dict[str, str]:
    """Metric key -> its floor (scripts/floors.py: decode tok/s at the HBM floor, prefill tok/s at the
    tensor-core floor) for ``model`` on the card the runs name; empty without ``model``."""
    if not model:
        return {}
    from scripts.floors import CARDS, Card, floors, load_config

    devices = {r.get("device", "") for r in results.values()}
    card = "h100" if any("H100" in d for d in devices) else "h200"
    keys = {k for r in results.values() for k in r}
    batches = [int(k.rsplit("_b", 1)[1]) for k in keys if k.startswith("decode_tok_s_b")]
    lens = [int(k.rsplit("_", 1)[1]) for k in keys if k.startswith("prefill_tok_s_")]
    found = floors(load_config(model, None), Card(*CARDS[card]), batches=batches, lens=lens)
    return ({f"decode_tok_s_b{b}": f"{r['tok_s']:,.0f} ({card})" for b, r in found["decode"].items()}
            | {f"prefill_tok_s_{n}": f"{r['tok_s']:,.0f} ({card})" for n, r in found["prefill"].items()})


def report(results: dict[str, dict], model: str | None = None) -> str:
    """The table of one or both engines' runs; with ``model`` (the checkpoint), a column of floors."""
    ours, theirs = results.get("plugin", {}), results.get("intree", {})
    floor = floor_cells(results, model)
    extra = (" floor |", " --- |") if floor else ("", "")
    lines = ["| metric | plugin | in-tree | plugin / in-tree |" + extra[0], "| --- | --- | --- | --- |" + extra[1]]
    for key, label, fmt, better in table_rows({k for r in results.values() for k in r}):
        a, b = ours.get(key), theirs.get(key)
        ratio = f"{a / b:.2f}" if a is not None and b else "-"
        ratio += f" ({better} is better)" if better != "-" and ratio != "-" else ""
        cell = lambda v: fmt.format(v) if v is not None else "-"  # noqa: E731
        lines.append(f"| {label} | {cell(a)} | {cell(b)} | {ratio} |" + (f" {floor.get(key, '-')} |" if floor else ""))
    devices = sorted({r["device"] for r in results.values() if r.get("device")})
    if devices:
        lines.append(f"\ndevice: {', '.join(devices)}")
    if ours.get("env"):
        lines.append(f"\nplugin settings: {' '.join(f'{k}={v}' for k, v in ours['env'].items())}")
    return "\n".join(lines)


def plugin_entry_point_installed() -> bool:
    from importlib.metadata import entry_points

    return any(e.value.startswith("vllm_dsv4") for e in entry_points(group="vllm.general_plugins"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--engines", default="plugin,intree")
    ap.add_argument("--out", type=Path, help="save the results (JSON) here")
    ap.add_argument("--max-model-len", type=int, default=40960)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.8)
    ap.add_argument("--report", nargs="+", type=Path,
                    help="print the table of saved runs and exit (with --model: their floors beside them)")
    ap.add_argument("--decode-batches", default=",".join(map(str, DECODE_BATCHES)))
    ap.add_argument("--prefill-lens", default=",".join(map(str, PREFILL_LENS)))
    ap.add_argument("--profile", action="store_true",
                    help="also write torch-profiler kernel tables of decode and prefill steps next to --out")
    ap.add_argument("--mtp", type=int, default=0, help="MTP draft tokens per step (speculative decoding); 0: off")
    ap.add_argument("--first-start", action="store_true",
                    help="start each engine once beforehand in its own process and report that start too")
    ap.add_argument("--jit-root", type=Path,
                    help="each engine's JIT caches under JIT_ROOT/<engine>, emptied first (a cold first start)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--first-requests", action=argparse.BooleanOptionalAction, default=True,
                    help="time the first requests after ready (--no-first-requests: skip them)")
    ap.add_argument("--ready-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.worker:  # one engine, in this process
        ints = lambda csv: tuple(int(v) for v in csv.split(","))  # noqa: E731
        profile_path = args.out.with_suffix(".profile") if args.profile else None
        result = run_engine(args.worker, args.model, args.max_model_len, args.gpu_memory_utilization,
                            ints(args.decode_batches), ints(args.prefill_lens), profile_path, args.mtp,
                            args.ready_only, args.first_requests)
        args.out.write_text(json.dumps(result, indent=2))
        return 0
    if args.report:
        results = {}
        for saved in (json.loads(p.read_text()) for p in args.report):  # one engine's run, or several
            results.update({saved["engine"]: saved} if "engine" in saved else saved)
        print(report(results, args.model))
        return 0

    if "plugin" in args.engines.split(",") and not plugin_entry_point_installed():
        # VLLM_PLUGINS names a plugin vLLM cannot find without a word: the in-tree model would be timed as ours
        sys.exit(f"vllm_dsv4's entry point is not installed for {sys.executable}: "
                 f"`{sys.executable} -m pip install --no-deps --no-build-isolation -e .` first")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
    results = {}
    for name in args.engines.split(","):
        out = (args.out or Path(".")).with_suffix(f".{name}.json")
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", **ENGINES[name]["env"])
        if args.jit_root:
            env.update(jit_cache_env(args.jit_root / name))
        cmd = [sys.executable, __file__, "--worker", name, "--model", args.model, "--out", str(out),
               "--max-model-len", str(args.max_model_len),
               "--gpu-memory-utilization", str(args.gpu_memory_utilization),
               "--decode-batches", args.decode_batches, "--prefill-lens", args.prefill_lens, "--mtp", str(args.mtp),
               "--first-requests" if args.first_requests else "--no-first-requests"]
        first = None
        if args.first_start:
            if subprocess.run(cmd + ["--ready-only"], env=env).returncode != 0:
                print(f"[{name}] first engine start failed", file=sys.stderr)
                continue
            first = json.loads(out.read_text())["time_to_ready_s"]
            print(f"[{name}] first start: ready in {first:.1f} s", flush=True)
        cmd += ["--profile"] if args.profile else []
        if subprocess.run(cmd, env=env).returncode != 0:
            print(f"[{name}] engine run failed", file=sys.stderr)
            continue
        first_key = "time_to_ready_cold_s" if args.jit_root else "time_to_ready_first_s"
        results[name] = json.loads(out.read_text()) | ({first_key: first} if first else {})
        out.write_text(json.dumps(results[name], indent=2))
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))
    print(report(results))
    return 0 if len(results) == len(args.engines.split(",")) else 1


if __name__ == "__main__":
    sys.exit(main())
