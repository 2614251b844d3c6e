"""How fast the host copies a capture's rows on their way to disk, by how the copy is made.

    python -m benchmarks.host_copy_rates [--root DIR] [--chunk-mb 8] [--buffer-mb 256] [--rounds 2]

A consumer in its own process (capture/isolation.py) receives each request's rows in a shared-memory block;
the sharded layout once copied them into shard memory for its writer thread to write out (it now writes
from the lent blocks themselves). This measures
each way of making that copy on this machine, in rounds (A B C .. A B C ..): ``torch.Tensor.copy_`` with
torch's own thread count and with one thread, ``numpy.copyto``, each into fresh memory and into memory
already touched; then a chunk at a time straight from the shared block to a file (``os.write``) against one
synced write of the buffer, for scale. Prints MB/s per way and round.
"""

import argparse
import mmap
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import numpy as np
import torch

from benchmarks.consumer_handoff import plain_write_mb_s


def shared_block(nbytes: int) -> mmap.mmap:
    """``nbytes`` of /dev/shm, mapped and filled, as the worker leaves a block it gathered rows into."""
    fd, path = tempfile.mkstemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    os.unlink(path)
    os.posix_fallocate(fd, 0, nbytes)
    block = mmap.mmap(fd, nbytes)
    os.close(fd)
    np.frombuffer(block, dtype=np.uint8)[:] = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    return block


def copy_rate(copy: Callable[[np.ndarray, np.ndarray], None], source: np.ndarray, buffer_bytes: int,
              fresh: bool) -> float:
    """MB/s filling a ``buffer_bytes`` buffer with ``source`` chunk after chunk."""
    chunk = source.size
    target = np.empty(buffer_bytes, dtype=np.uint8)
    if not fresh:
        target[:] = 1
    started = time.perf_counter()
    for offset in range(0, buffer_bytes - chunk + 1, chunk):
        copy(target[offset: offset + chunk], source)
    return buffer_bytes / 1e6 / (time.perf_counter() - started)


def torch_copy(threads: int | None) -> Callable[[np.ndarray, np.ndarray], None]:
    def copy(target: np.ndarray, source: np.ndarray) -> None:
        before = torch.get_num_threads()
        if threads is not None:
            torch.set_num_threads(threads)
        try:
            torch.from_numpy(target).copy_(torch.from_numpy(source))
        finally:
            torch.set_num_threads(before)
    return copy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", default=tempfile.gettempdir())
    parser.add_argument("--chunk-mb", type=int, default=8)
    parser.add_argument("--buffer-mb", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    chunk, buffer_bytes = args.chunk_mb << 20, args.buffer_mb << 20
    source = np.frombuffer(shared_block(chunk), dtype=np.uint8)
    ways: dict[str, Callable[[], float]] = {}
    for fresh in (True, False):
        into = "fresh" if fresh else "touched"
        ways[f"torch copy_ ({torch.get_num_threads()} threads), {into}"] = (
            lambda fresh=fresh: copy_rate(torch_copy(None), source, buffer_bytes, fresh))
        ways[f"torch copy_ (1 thread), {into}"] = lambda fresh=fresh: copy_rate(torch_copy(1), source, buffer_bytes,
                                                                                fresh)
        ways[f"numpy copyto, {into}"] = lambda fresh=fresh: copy_rate(np.copyto, source, buffer_bytes, fresh)
    ways["os.write per chunk + fsync"] = lambda: plain_write_mb_s(args.root, buffer_bytes, memoryview(source))
    rates: dict[str, list[float]] = {way: [] for way in ways}
    for _ in range(args.rounds):
        for way, measure in ways.items():
            rates[way].append(measure())
    print(f"{args.chunk_mb} MiB chunks from /dev/shm into {args.buffer_mb} MiB, root {args.root}\n\n"
          "| copy | MB/s per round | median |\n|---|---|---|")
    for way, values in rates.items():
        print(f"| {way} | {' / '.join(f'{v:.0f}' for v in values)} | {statistics.median(values):.0f} |")


if __name__ == "__main__":
    main()
