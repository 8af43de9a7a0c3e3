"""What registering the plugin sets up in a process beyond the model classes."""

import os
import subprocess
import sys


def _triton_cache_dir(env: dict) -> str:
    """``TRITON_CACHE_DIR`` and Triton's own cache folder in a fresh process after ``register()``."""
    code = ("import os, triton; from vllm_dsv4 import plugin; plugin.register(); "
            "print(os.environ['TRITON_CACHE_DIR']); print(triton.knobs.cache.dir)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    first, second = out.split()[-2:]
    assert first == second
    return first


def test_triton_caches_kernels_under_vllms_cache_root_unless_told_otherwise(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_CACHE_DIR"} | {"VLLM_CACHE_ROOT": str(tmp_path)}
    assert _triton_cache_dir(env) == str(tmp_path / "triton")
    assert _triton_cache_dir(env | {"TRITON_CACHE_DIR": str(tmp_path / "mine")}) == str(tmp_path / "mine")
