"""Tokens/s of the plugin on CPU (tiny preset by default). A benchmark, not a test.

    .venv/bin/python scripts/bench_cpu.py [--ckpt DIR] [--dtype float32|bfloat16]

vLLM's in-tree DeepSeek-V4 cannot run on this kind of CPU (its kernels need AVX512-BF16), so there is
no in-tree line here; the GPU benchmark (scripts/bench_gpu.py, GPU issue) carries the comparison.
"""

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def timed_generate(llm, prompts, max_tokens):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    start = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", help="checkpoint folder (default: a fresh tiny one)")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    from make_checkpoint import make_checkpoint

    ckpt = Path(args.ckpt) if args.ckpt else make_checkpoint(Path(tempfile.mkdtemp()) / "tiny", "tiny", seed=0)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    start = time.perf_counter()
    llm = LLM(model=str(ckpt), dtype=args.dtype, max_model_len=2048, max_num_seqs=16, enforce_eager=True,
              skip_tokenizer_init=True, seed=0)
    ready = time.perf_counter() - start
    rows = [("time to ready (s)", f"{ready:.1f}")]
    timed_generate(llm, [[5] * 16], 4)  # warm-up
    for num_prompts, length in ((1, 1024), (8, 512)):
        seconds, _ = timed_generate(llm, [[(7 * i + j) % 1000 + 2 for j in range(length)] for i in range(num_prompts)], 1)
        rows.append((f"prefill {num_prompts}x{length} tok/s", f"{num_prompts * length / seconds:,.0f}"))
    for batch in (1, 8, 16):
        seconds, generated = timed_generate(llm, [[(3 * i + j) % 1000 + 2 for j in range(128)] for i in range(batch)], 128)
        rows.append((f"decode batch {batch} output tok/s (128-token prompts, 128 out)", f"{generated / seconds:,.1f}"))
    width = max(len(k) for k, _ in rows)
    print(f"vllm-dsv4 on CPU, {ckpt}, dtype {args.dtype}")
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")


if __name__ == "__main__":
    main()
