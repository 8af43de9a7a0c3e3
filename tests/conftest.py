"""Shared pytest fixtures: tiny random checkpoints (generated once per session), the `gpu` marker, and
the rule that a run without CUDA fails on a skip other than those tests/skips.py allows."""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from tests.skips import ALLOWED_WITHOUT_CUDA  # noqa: E402


def load_module_by_path(path: str | Path, name: str | None = None) -> ModuleType:
    """Import a .py file that is not on a package path (scripts/, tests/oracle/); cached by name."""
    path = Path(path).resolve()
    name = name or f"_dsv4_{path.stem}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def load_make_checkpoint() -> ModuleType:
    """scripts/make_checkpoint.py as a module (make_checkpoint, make_config, ...)."""
    return load_module_by_path(REPO_ROOT / "scripts" / "make_checkpoint.py", "dsv4_make_checkpoint")


def load_quantize() -> ModuleType:
    """scripts/quantize.py as a module (quant_fp8_block, quant_mxfp4: the checkpoint maker's encoders)."""
    return load_module_by_path(REPO_ROOT / "scripts" / "quantize.py", "dsv4_quantize")


def load_hf_oracle() -> ModuleType:
    """tests/oracle/hf_oracle.py as a module (load_hf_reference, ...)."""
    return load_module_by_path(REPO_ROOT / "tests" / "oracle" / "hf_oracle.py", "dsv4_hf_oracle")


@pytest.fixture(scope="session")
def make_checkpoint_module() -> ModuleType:
    return load_make_checkpoint()


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory, make_checkpoint_module) -> Path:
    """TINY preset, quantized (FP8 linears + MXFP4 experts), seed 0. Treat as read-only."""
    return make_checkpoint_module.make_checkpoint(tmp_path_factory.mktemp("tiny_q"), "tiny", quantized=True, seed=0)


@pytest.fixture(scope="session")
def tiny_base_ckpt(tmp_path_factory, make_checkpoint_module) -> Path:
    """TINY in V4-Flash-Base's format (FP8 linears and routed experts, float32 scales), seed 0. Read-only."""
    return make_checkpoint_module.make_checkpoint(tmp_path_factory.mktemp("tiny_base"), "tiny-base", seed=0)


@pytest.fixture(scope="session")
def ktiny_ckpt(tmp_path_factory, make_checkpoint_module) -> Path:
    """Kernel-shaped preset (head_dim 512, rope 64, indexer 16x128, top-64; every FP8 linear whole
    128x128 blocks), FP8 + MXFP4, seed 0. Read-only."""
    return make_checkpoint_module.make_checkpoint(tmp_path_factory.mktemp("ktiny"), "ktiny", quantized=True, seed=0)


@pytest.fixture(scope="session")
def tiny_ckpt_unquantized(tmp_path_factory, make_checkpoint_module) -> Path:
    """TINY preset, same function stored in bf16 (no quantization_config), seed 0. Read-only."""
    return make_checkpoint_module.make_checkpoint(tmp_path_factory.mktemp("tiny_u"), "tiny", quantized=False, seed=0)


@pytest.fixture(scope="session")
def tiny_0731_ckpt(tmp_path_factory, make_checkpoint_module) -> Path:
    """tiny-0731 preset (TINY with V4-Flash-0731's DSpark drafter), FP8 + MXFP4, seed 0. Read-only. (No
    "dspark" in the path: vLLM picks the dspark method for any model path containing it.)"""
    return make_checkpoint_module.make_checkpoint(tmp_path_factory.mktemp("tiny_0731_q"), "tiny-0731", seed=0)


@pytest.fixture(scope="session")
def tiny_0731_ckpt_unquantized(tmp_path_factory, make_checkpoint_module) -> Path:
    """tiny-0731, the same function stored in bf16, seed 0. Read-only."""
    return make_checkpoint_module.make_checkpoint(tmp_path_factory.mktemp("tiny_0731_u"), "tiny-0731",
                                                  quantized=False, seed=0)


@pytest.fixture
def cpu_ops(monkeypatch):
    """Model modules on CPU tensors on a CUDA machine: ``vllm_dsv4.ops`` as it is with
    ``VLLM_DSV4_OPS=reference`` (ops picks its Triton kernels and vLLM's GEMMs at import, and those
    only take CUDA tensors). Without CUDA it changes nothing."""
    from vllm_dsv4 import ops

    monkeypatch.setenv("VLLM_DSV4_OPS", "reference")
    reference = load_module_by_path(ops.__file__, "vllm_dsv4_ops_reference")
    for name in ops.__all__ + [n for n in vars(ops) if n.isupper()]:
        monkeypatch.setattr(ops, name, getattr(reference, name))


@functools.cache
def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # pragma: no cover
        return False


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "gpu: needs CUDA (skipped without it)")


def pytest_collection_modifyitems(config, items) -> None:
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if item.get_closest_marker("gpu"):  # not ``"gpu" in item.keywords``: that holds folder names too
            item.add_marker(skip)


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")


def _fail_a_hidden_test(report, what: str) -> None:
    """Without CUDA every test not marked ``gpu`` must run (CI runs on a CPU machine): an optional
    dependency gone missing or a condition gone wrong would otherwise hide whole chains of tests."""
    reason = _skip_reason(report)
    if reason in ALLOWED_WITHOUT_CUDA:
        return
    report.outcome = "failed"
    report.longrepr = (f"{what} skipped on a machine without CUDA, where it must run ({reason}); "
                       "tests/skips.py lists the skips allowed there")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if (report.skipped and not hasattr(report, "wasxfail") and item.get_closest_marker("gpu") is None
            and not _cuda_available()):
        _fail_a_hidden_test(report, item.nodeid)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    report = (yield).get_result()
    if report.skipped and not _cuda_available():
        _fail_a_hidden_test(report, f"{collector.nodeid} (all of it)")
