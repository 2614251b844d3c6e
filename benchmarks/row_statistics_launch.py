"""Host time of ``logging``'s per-step row statistics on a GPU: the torch reduction against the one-launch kernel.

    python -m benchmarks.row_statistics_launch [--sites 16] [--rows 64] [--hidden 2048] [--calls 2000]

Times ``--calls`` calls on the calling thread with no synchronisation between them (what the forward thread
pays per capturing step), then the device time of the same calls, for a ``[sites, rows, hidden]`` bf16 block;
A B A B, three rounds. CUDA only.
"""

import argparse
import time

import torch

from vllm_interp.capture.consumers.logging import STATS, torch_row_statistics
from vllm_interp.capture.consumers.statistics_kernel import row_statistics_kernel


def timed(fn, block: torch.Tensor, calls: int) -> tuple[float, float]:
    """(host us per call, wall us per call including the device)."""
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(calls):
        fn(block)
    launched = time.perf_counter()
    torch.cuda.synchronize()
    done = time.perf_counter()
    return (launched - started) / calls * 1e6, (done - started) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sites", type=int, default=16)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    block = torch.randn(args.sites, args.rows, args.hidden, device="cuda").to(torch.bfloat16)
    kernel = lambda rows: row_statistics_kernel(rows, len(STATS))  # noqa: E731
    torch.testing.assert_close(kernel(block), torch_row_statistics(block), rtol=1e-5, atol=1e-5)
    for fn in (torch_row_statistics, kernel):
        timed(fn, block, 50)  # warm-up (the kernel's compile)
    print(f"[{args.sites}, {args.rows}, {args.hidden}] bf16, {args.calls} calls, us per call (host / with device)")
    for round_index in range(3):
        for name, fn in (("torch", torch_row_statistics), ("kernel", kernel)):
            host, wall = timed(fn, block, args.calls)
            print(f"round {round_index} {name}: {host:.1f} / {wall:.1f}")


if __name__ == "__main__":
    main()
