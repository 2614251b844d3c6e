"""What the server benchmarks share: starting `vllm-interp serve` on loopback and watching its processes."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import requests

VLLM_INTERP = str(Path(sys.executable).with_name("vllm-interp"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(args: list[str], log: Path, env: dict[str, str] | None = None,
                 timeout_s: float = 900) -> tuple[str, subprocess.Popen]:
    """`vllm-interp serve ARGS` in its own process group, output to ``log``; returns once /health answers."""
    port = free_port()
    with open(log, "w") as out:
        process = subprocess.Popen([VLLM_INTERP, "serve", "--port", str(port), *args], stdout=out,
                                   stderr=subprocess.STDOUT, env=env or os.environ, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}; see {log}")
        try:
            if requests.get(f"{url}/health", timeout=2).ok:
                return url, process
        except requests.ConnectionError:
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


def server_rss_mb(pid: int) -> dict[str, float]:
    """Resident memory (MiB) of the server and each process it started, by ``name/pid``."""
    root = psutil.Process(pid)
    rss = {}
    for process in [root, *root.children(recursive=True)]:
        try:
            rss[f"{process.name()}/{process.pid}"] = process.memory_info().rss / 2**20
        except psutil.NoSuchProcess:
            continue
    return rss
