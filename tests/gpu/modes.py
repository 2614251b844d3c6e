"""Each engine mode's results, run once per session in a process of its own, and what the tests read from them."""

import collections
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from tests.gpu.engine_run import build_llama, gpus_needed
from vllm_interp.capture.consumers.inline import ResidualReadout

ROOT = Path(__file__).resolve().parents[2]
# A whole graph-mode process took about 80 s on an H100 (engine start 51 s: torch.compile and graph capture);
# a hung engine is killed before a 600 s device call ends, so the log still comes back.
ENGINE_TIMEOUT_S = 420


class EngineModes:
    """``engines("eager", "graphs")`` -> {mode: results saved by ``tests.gpu.engine_run``}.

    Modes not run yet run now; one-GPU modes side by side on separate GPUs where there are enough, the rest
    one after another. A mode that failed fails every later test that needs it, without running again.
    """

    def __init__(self, base: Path) -> None:
        self.base = base
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
        singles = [m for m in missing if gpus_needed(m) == 1]
        batches = [singles[i : i + gpus] for i in range(0, len(singles), gpus)]
        for batch in [*batches, *([m] for m in missing if gpus_needed(m) > 1)]:
            self._run_side_by_side(batch)
        for mode in modes:
            if mode in self.failures:
                pytest.fail(self.failures[mode], pytrace=False)
        return {mode: self.results[mode] for mode in modes}

    def _run_side_by_side(self, batch: list[str]) -> None:
        started = [(mode, *self._start(mode, gpu)) for gpu, mode in enumerate(batch)]
        for mode, process, tail, reader in started:
            try:
                process.wait(ENGINE_TIMEOUT_S)
                how = f"exited with {process.returncode}"
            except subprocess.TimeoutExpired:
                # Its own session: the TP/PP workers the engine spawned go with it.
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                how = f"was killed after {ENGINE_TIMEOUT_S} s"
            reader.join()
            out = self.base / f"{mode}.pt"
            if process.returncode == 0 and out.exists():
                self.results[mode] = result = torch.load(out, weights_only=True)
                print_figure(f"{mode} engine", f"init {result['engine_init_s']:.1f} s, "
                                               f"cudagraph_mode {result['cudagraph_mode']}")
            else:
                self.failures[mode] = f"{mode} engine {how}; last lines:\n" + "".join(tail)

    def _start(self, mode: str, gpu: int):
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        if gpus_needed(mode) == 1:
            env["CUDA_VISIBLE_DEVICES"] = str(gpu)
        command = [sys.executable, "-m", "tests.gpu.engine_run", mode, str(self.model), str(self.capture_root(mode)),
                   str(self.base / f"{mode}.pt")]
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True, start_new_session=True)
        tail: collections.deque[str] = collections.deque(maxlen=60)

        def relay() -> None:
            # Prefixed, since two engines can print at once.
            for line in process.stdout:
                tail.append(line)
                print(f"[{mode}] {line}", end="", flush=True)

        reader = threading.Thread(target=relay, daemon=True)
        reader.start()
        return process, tail, reader


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
