"""A vLLM OpenAI server on the tiny checkpoint, as a subprocess on 127.0.0.1 (helpers for the e2e tests)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

STARTUP_TIMEOUT_S = 240
RUNNING: dict[str, subprocess.Popen] = {}  # base URL -> server process, while vllm_server runs it
ENGINE_FLAGS = ["--max-model-len", "2048", "--enforce-eager", "--dtype", "float32", "--max-num-seqs", "4",
                "--served-model-name", "tiny"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerExited(RuntimeError):
    pass


@contextmanager
def vllm_server(args: list[str], workdir: Path, env_updates: dict[str, str], drop_env: tuple[str, ...] = ()):
    """Run ``python <args> --host 127.0.0.1 --port P``; yields ``(base URL, log path)`` once /health answers.

    The server gets its own session so teardown stops its whole process group (API server, engine core,
    worker). A server that exits while starting is started once more on a fresh port (on a shared
    2-core box the port picked here can be taken before vLLM binds it); its log is printed.
    """
    env = {k: v for k, v in os.environ.items() if k not in drop_env}
    env.update({"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CACHE_ROOT": str(workdir / "vllm_cache")}, **env_updates)
    for attempt in (1, 2):
        port = free_port()
        log_path = workdir / f"server-{port}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen([sys.executable, *args, "--host", "127.0.0.1", "--port", str(port)], cwd=workdir,
                                    env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            base = wait_healthy(proc, f"http://127.0.0.1:{port}", log_path)
        except ServerExited:
            stop(proc)
            if attempt == 2:
                raise
            print(f"server exited while starting; retrying. Log:\n{log_tail(log_path)}", file=sys.stderr)
            continue
        except BaseException:
            stop(proc)
            raise
        RUNNING[base] = proc
        try:
            yield base, log_path
        finally:
            RUNNING.pop(base, None)
            stop(proc)
        return


@contextmanager
def running_pd_proxy(prefill: str, decode: str, workdir: Path):
    """scripts/pd_proxy.py in front of a prefill and a decode server; yields its base URL once healthy."""
    port = free_port()
    log_path = workdir / "proxy.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve().parents[2] / "scripts" / "pd_proxy.py"),
                                 "--prefill", prefill, "--decode", decode, "--port", str(port)],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield wait_healthy(proc, f"http://127.0.0.1:{port}", log_path)
    finally:
        stop(proc)


def wait_healthy(proc: subprocess.Popen, base: str, log_path: Path) -> str:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise ServerExited(f"server exited with {proc.returncode}:\n{log_tail(log_path)}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return base
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"server not healthy after {STARTUP_TIMEOUT_S}s:\n{log_tail(log_path)}")
        time.sleep(1)


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group, then SIGKILL to whatever of the group is left."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass


def log_tail(path: Path, chars: int = 6000) -> str:
    return path.read_text(errors="replace")[-chars:]
