"""The main job: make a tiny DeepSeek-V4 checkpoint (official format) and generate text from it
with vLLM's offline ``LLM`` API, the plugin loaded through its entry point.

    .venv/bin/python scripts/run_tiny.py [--ckpt DIR] [--unquantized]
"""

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", default="tiny-dsv4", help="checkpoint folder (made if missing)")
    parser.add_argument("--unquantized", action="store_true", help="bf16 weights instead of FP8/MXFP4")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()

    from make_checkpoint import make_checkpoint

    ckpt = Path(args.ckpt)
    if not (ckpt / "config.json").exists():
        make_checkpoint(ckpt, "tiny", quantized=not args.unquantized, seed=0)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    from vllm import LLM, SamplingParams

    llm = LLM(model=str(ckpt), max_model_len=1024, enforce_eager=True, seed=0)
    prompts = ["DeepSeek-V4 compresses its history into", "The quick brown fox"]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    for out in llm.generate(prompts, params):
        print(f"{out.prompt!r} -> {out.outputs[0].text!r} ({len(out.outputs[0].token_ids)} tokens)")


if __name__ == "__main__":
    main()
