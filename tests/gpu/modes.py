"""Each engine mode's results, run once per session in a process of its own, and what the tests read from them."""

import collections
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.gpu.engine_run import MULTIPROCESS_MODES, V1_MODES, build_llama, gpus_needed
from vllm_interp.capture.consumers.inline import ResidualReadout

ROOT = Path(__file__).resolve().parents[2]
# A whole graph-mode process took about 80 s on an H100 (engine start 51 s: torch.compile and graph capture);
# a hung engine is killed before a 600 s device call ends, so the log still comes back.
ENGINE_TIMEOUT_S = 420
# A multiprocess mode starts its engine MP_STARTS (3) times, about 30 s each when warm (51 s cold), and runs the
# workloads once: 240 s is about twice that, and short enough that a hang there leaves the device call time for
# the other modes.
MODE_TIMEOUT_S = {mode: 240 for mode in MULTIPROCESS_MODES}
# After SIGABRT, time for every process of a stuck mode to write its thread stacks before SIGKILL.
DUMP_GRACE_S = 15
# The one-GPU modes, asked for together so that they share the GPUs from the start.
ONE_GPU_MODES = ("eager", "graphs", "graphs_mp", "v1_eager", "v1_graphs")


class _ModeProcess:
    """One mode's ``tests.gpu.engine_run`` process: its output relayed line by line, its last lines kept."""

    def __init__(self, modes: "EngineModes", mode: str, gpu: int | None) -> None:
        self.mode = mode
        # The engine core in a process of its own only in the multiprocess modes (why: engine_run's docstring).
        multiprocessing = "1" if mode in MULTIPROCESS_MODES else "0"
        # PYTHONFAULTHANDLER: every Python process of the mode (the engine core and workers inherit it) writes
        # all its threads' stacks on SIGABRT, which is how a stuck mode is ended (see finish).
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": multiprocessing, "PYTHONFAULTHANDLER": "1"}
        env.pop("VLLM_USE_V2_MODEL_RUNNER", None)  # vLLM's own choice (V2), unless the mode asks for V1
        if mode in V1_MODES:
            env["VLLM_USE_V2_MODEL_RUNNER"] = "0"
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(gpu)
        command = [sys.executable, "-m", "tests.gpu.engine_run", mode, str(modes.model),
                   str(modes.capture_root(mode)), str(modes.base / f"{mode}.pt")]
        self.started = time.monotonic()
        self.deadline = self.started + MODE_TIMEOUT_S.get(mode, ENGINE_TIMEOUT_S)
        self.process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True, start_new_session=True)
        # Long enough for a stack dump of the frontend's threads; the whole output is in the log anyway.
        self.tail: collections.deque[str] = collections.deque(maxlen=150)
        self.reader = threading.Thread(target=self._relay, daemon=True)
        self.reader.start()

    def _relay(self) -> None:
        # Prefixed, since two engines can print at once.
        for line in self.process.stdout:
            self.tail.append(line)
            print(f"[{self.mode}] {line}", end="", flush=True)

    def running(self) -> bool:
        return self.process.poll() is None and time.monotonic() < self.deadline

    def finish(self) -> str:
        """Waits for the process (ending it at its deadline); says how it ended."""
        try:
            self.process.wait(max(0.0, self.deadline - time.monotonic()))
            how = f"exited with {self.process.returncode}"
        except subprocess.TimeoutExpired:
            # Its own session: the engine core and workers the engine started go with it. SIGABRT first, so that
            # each process writes its stacks (faulthandler), then SIGKILL for any that survive.
            print(f"[{self.mode}] stuck after {time.monotonic() - self.started:.0f} s: SIGABRT to every process "
                  f"of the mode (thread stacks follow), SIGKILL in {DUMP_GRACE_S} s", flush=True)
            os.killpg(self.process.pid, signal.SIGABRT)
            time.sleep(DUMP_GRACE_S)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
            how = f"was killed after {self.deadline - self.started:.0f} s (thread stacks above)"
        # An orphaned engine core could keep the pipe open; it is killed with the group, but never wait forever.
        self.reader.join(30)
        return how


class EngineModes:
    """``engines("eager", "graphs")`` -> {mode: results saved by ``tests.gpu.engine_run``}.

    Modes not run yet run now; one-GPU modes side by side, each starting on the first free GPU, the rest
    one after another. A mode that failed fails every later test that needs it, without running again.
    """

    def __init__(self, base: Path, side_by_side: tuple[str, ...] = ONE_GPU_MODES) -> None:
        self.base = base
        self.side_by_side = side_by_side
        self.model = build_llama(base / "llama")
        self.results: dict[str, dict] = {}
        self.failures: dict[str, str] = {}

    def capture_root(self, mode: str) -> Path:
        return self.base / "captures" / mode

    def __call__(self, *modes: str) -> dict[str, dict]:
        gpus = torch.cuda.device_count()
        for mode in modes:
            if gpus_needed(mode) > gpus:
                pytest.skip(f"{mode} needs {gpus_needed(mode)} GPUs; this machine has {gpus}")
        missing = [m for m in modes if m not in self.results and m not in self.failures]
        self._run_one_gpu_modes([m for m in missing if gpus_needed(m) == 1], gpus)
        for mode in missing:
            if gpus_needed(mode) > 1:
                self._collect(_ModeProcess(self, mode, None))
        for mode in modes:
            if mode in self.failures:
                pytest.fail(self.failures[mode], pytrace=False)
        return {mode: self.results[mode] for mode in modes}

    def alongside(self, *modes: str) -> dict[str, dict]:
        """``modes``' results, asked for with the one-GPU modes this session's tests name, so that those start
        side by side (rather than one after another as tests ask for them)."""
        return self(*dict.fromkeys([*self.side_by_side, *modes]))

    def _run_one_gpu_modes(self, queue: list[str], gpus: int) -> None:
        # A GPU freed by a short mode (eager) takes the next mode at once, rather than after the longest one.
        running: dict[int, _ModeProcess] = {}
        queue = list(queue)
        while queue or running:
            for gpu in range(gpus):
                if gpu not in running and queue:
                    running[gpu] = _ModeProcess(self, queue.pop(0), gpu)
            time.sleep(1)
            for gpu, process in list(running.items()):
                if not process.running():
                    self._collect(process)
                    del running[gpu]

    def _collect(self, process: _ModeProcess) -> None:
        mode, how = process.mode, process.finish()
        out = self.base / f"{mode}.pt"
        if process.process.returncode == 0 and out.exists():
            self.results[mode] = result = torch.load(out, weights_only=True)
            print_figure(f"{mode} engine", f"init {result['engine_init_s']:.1f} s, "
                                           f"cudagraph_mode {result['cudagraph_mode']}")
        else:
            self.failures[mode] = f"{mode} engine {how}; last lines:\n" + "".join(process.tail)


def with_eager(engines: EngineModes, mode: str) -> dict[str, dict]:
    """``mode``'s results and eager's (a one-GPU mode with the others the session's tests name)."""
    return engines.alongside("eager", mode) if mode in ONE_GPU_MODES else engines("eager", mode)


def readouts(saved: dict) -> list[ResidualReadout]:
    """The read-outs an engine saved, as ``compare`` takes them."""
    return [ResidualReadout(r["positions"], r["tensors"], {}) for r in saved["readouts"]]


def print_figure(label: str, text: str) -> None:
    """One line of figures for the record (``run-on-device`` collects the GPU_FIGURE lines)."""
    print(f"\nGPU_FIGURE {label}: {text}", flush=True)


def report(label: str, result) -> None:
    """A parity comparison's figures."""
    print_figure(label, f"sites {result.sites_checked}, rows {result.rows_checked}, "
                        f"max abs diff {result.max_abs_diff:.3e}, max rel diff {result.max_rel_diff:.3e}")
