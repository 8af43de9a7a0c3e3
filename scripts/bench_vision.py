"""Time per image of the vision path: preprocessing (sizing, resample, patches, block layout) and the tower
(ViT + aligner) at a preset's dimensions, random weights. A benchmark, not a test.

    .venv/bin/python scripts/bench_vision.py [--preset flash-vision] [--vision-layers 32] [--dtype bfloat16]
                                             [--device cpu|cuda] [--repeat 3] [--sizes 224x224 1920x1080]

Prints one line per image size: the grids, then median seconds of preprocessing and of the tower.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from make_checkpoint import make_config  # noqa: E402

from vllm_dsv4.config import Dsv4Config  # noqa: E402
from vllm_dsv4.vision.layout import block_layout  # noqa: E402
from vllm_dsv4.vision.preprocess import to_patches  # noqa: E402
from vllm_dsv4.vision.tower import Aligner, ViT  # noqa: E402


def median_seconds(fn, repeat: int, sync) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="flash-vision", choices=("tiny-vision", "flash-vision"))
    parser.add_argument("--vision-layers", type=int, default=None)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--sizes", nargs="+", default=["224x224", "640x480", "1920x1080", "4000x500"])
    args = parser.parse_args()
    cfg = Dsv4Config.from_dict(make_config(args.preset, quantized=False, vision_layers=args.vision_layers))
    dtype, device = getattr(torch, args.dtype), torch.device(args.device)
    vit, aligner = ViT(cfg.vision).to(device, dtype).eval(), Aligner(cfg.vision, cfg.hidden_size).to(device, dtype).eval()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    print(f"{args.preset}: {cfg.vision.n_layers} ViT layers, dim {cfg.vision.dim}, hidden {cfg.hidden_size}, "
          f"{args.dtype} on {device}, torch threads {torch.get_num_threads()}, median of {args.repeat}")
    for size in args.sizes:
        w, h = (int(v) for v in size.split("x"))
        image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (h, w, 3), dtype=np.uint8))

        def preprocess():
            patches, grid = to_patches(image, cfg.vision)
            block_layout(grid.llm_h, grid.llm_w)
            return patches, grid

        patches, grid = preprocess()
        patches = patches.to(device)
        with torch.no_grad():
            encode = lambda: aligner(vit(patches, grid.vit_h, grid.vit_w), grid.vit_h, grid.vit_w)  # noqa: E731
            encode()  # warm-up
            tower = median_seconds(encode, args.repeat, sync)
        pre = median_seconds(preprocess, args.repeat, lambda: None)
        print(f"{size}: {grid.vit_h}x{grid.vit_w} patches -> {grid.llm_h}x{grid.llm_w} cells, "
              f"{grid.num_block_tokens} block tokens; preprocess {pre:.4f} s, tower {tower:.3f} s")


if __name__ == "__main__":
    main()
