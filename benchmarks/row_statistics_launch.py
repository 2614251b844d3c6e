"""Host time of ``logging``'s per-step row statistics on a GPU: the torch reduction against the one-launch kernel,
and a capturing step's whole summary path copied off step by step against blocks of steps.

    python -m benchmarks.row_statistics_launch [--sites 16] [--rows 64] [--hidden 2048] [--calls 2000]

Times ``--calls`` calls on the calling thread with no synchronisation between them (what the forward thread
pays per capturing step), then the device time of the same calls, for a ``[sites, rows, hidden]`` bf16 block;
A B A B, three rounds. The kernel is launched through Triton's argument binding every time, or again directly
as a steady batch's steps do. The step paths each reduce the block, start its copy to host memory and land the
copies that are done, as ``CaptureStore.collect`` and its drain do for a steady batch: one ``WholeCopy`` per
step (as before session 38), or ``ReducedSteps``. CUDA only.
"""

import argparse
import time
from collections import deque
from collections.abc import Callable

import torch

from vllm_interp.capture.consumers import statistics_kernel
from vllm_interp.capture.consumers.logging import ROW_STATISTICS, STATS, torch_row_statistics
from vllm_interp.capture.consumers.statistics_kernel import row_statistics_kernel
from vllm_interp.capture.host_copies import ReducedSteps, WholeCopy, to_host


def timed(fn: Callable[[torch.Tensor], object], block: torch.Tensor, calls: int) -> tuple[float, float]:
    """(host us per call, wall us per call including the device)."""
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(calls):
        fn(block)
    launched = time.perf_counter()
    torch.cuda.synchronize()
    done = time.perf_counter()
    return (launched - started) / calls * 1e6, (done - started) / calls * 1e6


def step_path(copy_of: Callable[[torch.Tensor], WholeCopy]) -> Callable[[torch.Tensor], None]:
    """One capturing step's summaries: reduced and on their way (``copy_of``), then every landed copy waited
    for in order, as the store's drain does at the next step."""
    pending: deque[WholeCopy] = deque()

    def one_step(block: torch.Tensor) -> None:
        while pending and pending[0].done():
            pending.popleft().wait()
        pending.append(copy_of(block))

    return one_step


def through_triton(fn: Callable[[torch.Tensor], object]) -> Callable[[torch.Tensor], object]:
    """``fn`` with the statistics kernel launched through Triton's argument binding every time (as before the
    kernel was launched again directly for a repeated view)."""
    def launched(rows: torch.Tensor) -> object:
        statistics_kernel._repeatable = None
        return fn(rows)

    return launched


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sites", type=int, default=16)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    block = torch.randn(args.sites, args.rows, args.hidden, device="cuda").to(torch.bfloat16)
    splits = [(row, row + 1) for row in range(args.rows)]
    kernel = lambda rows: row_statistics_kernel(rows, len(STATS))  # noqa: E731
    torch.testing.assert_close(kernel(block), torch_row_statistics(block), rtol=1e-5, atol=1e-5)
    steps = ReducedSteps(ROW_STATISTICS, (args.sites, args.rows, len(STATS)), block.device)
    paths = {
        "torch": torch_row_statistics,
        "kernel through Triton": through_triton(kernel),
        "kernel launched again": kernel,
        "step by step (through Triton)": step_path(through_triton(lambda rows: to_host(ROW_STATISTICS.reduce(rows),
                                                                                       splits))),
        "blocks of steps": step_path(lambda rows: steps.add(rows, splits)),
    }
    for fn in paths.values():
        timed(fn, block, 50)  # warm-up (the kernel's compile, torch's pinned cache)
    print(f"[{args.sites}, {args.rows}, {args.hidden}] bf16, {args.calls} calls, us per call (host / with device)")
    for round_index in range(3):
        for name, fn in paths.items():
            host, wall = timed(fn, block, args.calls)
            print(f"round {round_index} {name}: {host:.1f} / {wall:.1f}")


if __name__ == "__main__":
    main()
