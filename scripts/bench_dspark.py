"""Time of DSpark's draft step on CPU (tiny-0731 by default), beside the step it follows. A benchmark.

    .venv/bin/python scripts/bench_dspark.py [--ckpt DIR] [--dtype bfloat16|float32] [--tokens N ...]

Greedy decoding of B requests (128-token prompts, 64 out) with N draft tokens per step; the proposer's
``propose`` (context KV, the block through the stages, the Markov loop) is timed inside the engine, one
engine per N, and so is each whole engine step. Medians over the decode steps.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def timed(cls, name: str, samples: list) -> None:
    """Appends the wall time of each call of ``cls.name`` to ``samples``."""
    method = getattr(cls, name)

    def call(*args, **kwargs):
        start = time.perf_counter()
        out = method(*args, **kwargs)
        samples.append(time.perf_counter() - start)
        return out

    setattr(cls, name, call)


def run(ckpt: Path, dtype: str, n: int, batches: tuple[int, ...]) -> list[tuple[str, str]]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.engine.core import EngineCore

    from vllm_dsv4.spec_decode.dspark import DSparkProposer

    drafts, steps = [], []
    timed(DSparkProposer, "propose", drafts)
    timed(EngineCore, "step", steps)
    llm = LLM(model=str(ckpt), dtype=dtype, max_model_len=1024, max_num_seqs=16, enforce_eager=True,
              skip_tokenizer_init=True, seed=0, speculative_config={"method": "dspark", "num_speculative_tokens": n})
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, detokenize=False)
    rows = []
    for batch in batches:
        prompts = [TokensPrompt(prompt_token_ids=[(3 * i + j) % 1000 + 2 for j in range(128)]) for i in range(batch)]
        llm.generate(prompts, params, use_tqdm=False)  # warm-up
        drafts.clear(), steps.clear()
        llm.generate(prompts, params, use_tqdm=False)
        decode_drafts, decode_steps = drafts[1:], steps[1:]  # the first is the prefill's
        rows.append((f"N={n}, batch {batch}: draft step (ms)", f"{1e3 * statistics.median(decode_drafts):.2f}"))
        rows.append((f"N={n}, batch {batch}: whole engine step (ms)", f"{1e3 * statistics.median(decode_steps):.2f}"))
    del llm
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", help="checkpoint folder (default: a fresh tiny-0731 one)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", type=int, nargs="+", default=[5])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    args = parser.parse_args()
    from make_checkpoint import make_checkpoint

    ckpt = Path(args.ckpt) if args.ckpt else make_checkpoint(Path(tempfile.mkdtemp()) / "tiny", "tiny-0731", seed=0)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core and its worker in this process
    rows = [row for n in args.tokens for row in run(ckpt, args.dtype, n, tuple(args.batches))]
    width = max(len(k) for k, _ in rows)
    print(f"DSpark on CPU, {ckpt}, dtype {args.dtype} ({os.cpu_count()} cores)")
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")


if __name__ == "__main__":
    main()
