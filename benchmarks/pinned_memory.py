"""What pinned host memory costs the forward thread, by how it is had (a GPU machine).

    python -m benchmarks.pinned_memory [--block-mb 4] [--blocks 200] [--large-mb 512] [--rounds 3]

A capturing step copies its rows into pinned memory (``capture/host_copies.py``): a step block from torch's
pinned cache, a large block from the arena or pinned on its own. This times, per block, in rounds: taking a
``--block-mb`` block from torch's cache when ``--blocks`` of them were cached before (a hit), the same right
after the cache was emptied (each block pinned afresh, as a step did once the cache had been emptied under it),
and pinning and unpinning a ``--large-mb`` block of ordinary memory on its own (``pinned_on_its_own``). Prints
microseconds per block.
"""

import argparse
import statistics
import time

import torch

from vllm_interp.capture.host_copies import pinned_on_its_own


def take_blocks(count: int, nbytes: int) -> float:
    """Microseconds per block to take ``count`` pinned blocks of ``nbytes`` at once (held, then let go)."""
    start = time.perf_counter()
    held = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(count)]
    elapsed = time.perf_counter() - start
    del held
    return elapsed / count * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--block-mb", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=200)
    parser.add_argument("--large-mb", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    nbytes = args.block_mb << 20
    torch.cuda.init()
    take_blocks(args.blocks, nbytes)  # fills torch's cache
    rows: dict[str, list[float]] = {"cached (hit)": [], "after the cache was emptied": [],
                                    f"{args.large_mb} MiB pinned on its own, and unpinned": []}
    for _ in range(args.rounds):
        rows["cached (hit)"].append(take_blocks(args.blocks, nbytes))
        torch._C._host_emptyCache()  # a private name, present in the pinned torch 2.11
        rows["after the cache was emptied"].append(take_blocks(args.blocks, nbytes))
        start = time.perf_counter()
        _, unpin = pinned_on_its_own((args.large_mb << 20,), torch.uint8)
        unpin()
        rows[f"{args.large_mb} MiB pinned on its own, and unpinned"].append((time.perf_counter() - start) * 1e6)
    print(f"| how ({args.block_mb} MiB blocks, {args.blocks} at once) | us per block, by round | median |")
    print("|---|---|---|")
    for name, values in rows.items():
        print(f"| {name} | {' / '.join(f'{v:.0f}' for v in values)} | {statistics.median(values):.0f} |")


if __name__ == "__main__":
    main()
