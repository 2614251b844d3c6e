"""How fast finished requests' rows reach a consumer in its own process, by how many requests may be in flight.

    python -m benchmarks.consumer_handoff [--root DIR] [--layout sharded] [--requests 32] [--depths 1,2,4]
        [--rounds 2] [--sites 16] [--positions 512] [--hidden 2048]

Feeds ``--requests`` captures of ``sites x positions x hidden`` bf16 rows (32 MB each by default) through
``ConsumerRunner(InProcess(FilesystemConsumer))`` writing under a fresh directory in ``--root`` (a disk, or
``/dev/shm`` to take the disk out), with ``isolation.PIPELINE_DEPTH`` set to each of ``--depths`` in turn,
in rounds (A B C A B C), and prints MB/s per depth, then a plain synced write of 256 MB to the same root for
scale. No engine: the gather is one ``torch.cat`` of per-position chunks, as the store's is.
"""

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch

from vllm_interp.capture import isolation
from vllm_interp.capture.consumer import CaptureMeta, ConsumerContext, PendingCapture
from vllm_interp.capture.consumers.filesystem import FilesystemConsumer
from vllm_interp.capture.dispatch import ConsumerRunner
from vllm_interp.capture.results import ConsumerResult


def handoff_mb_s(args: argparse.Namespace, depth: int) -> float:
    isolation.PIPELINE_DEPTH = depth
    root = tempfile.mkdtemp(dir=args.root)
    options = FilesystemConsumer.validate_engine_options({"root": root, "layout": args.layout})
    context = ConsumerContext("filesystem", options, "m", num_layers=args.sites, hidden_size=args.hidden)
    runner = ConsumerRunner(isolation.InProcess(FilesystemConsumer, context), policy="block", queue_bytes=16 << 30)
    chunks = [torch.randn(args.sites, 1, args.hidden).to(torch.bfloat16) for _ in range(args.positions)]
    sites = [f"{layer}.post_block" for layer in range(args.sites)]
    closed = False
    try:
        started = time.perf_counter()
        futures = [runner.submit(PendingCapture(
            CaptureMeta(request_id=f"r{i}", tag=None, model="m", prompt_len=1, positions=list(range(args.positions)),
                        sites=sites, dtype="bfloat16"),
            args.hidden, torch.bfloat16, lambda block: torch.cat(chunks, dim=1, out=block)),
            ConsumerResult(status="ok", rows=args.positions * args.sites)) for i in range(args.requests)]
        for future in futures:
            assert future.result().status == "ok", future.result()
        runner.close()  # the last shard is published at close: its bytes are counted, so is its time
        closed = True
        seconds = time.perf_counter() - started
    finally:
        if not closed:
            runner.close()
        shutil.rmtree(root)
    return args.requests * args.sites * args.positions * args.hidden * 2 / 1e6 / seconds


def plain_write_mb_s(root: str, nbytes: int = 256 << 20) -> float:
    data = os.urandom(nbytes)
    fd, path = tempfile.mkstemp(dir=root)
    try:
        started = time.perf_counter()
        os.write(fd, data)
        os.fsync(fd)
        return nbytes / 1e6 / (time.perf_counter() - started)
    finally:
        os.close(fd)
        os.unlink(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", default=tempfile.gettempdir())
    parser.add_argument("--layout", default="sharded", choices=("sharded", "packed", "per_file"))
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--depths", default="1,2,4")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--sites", type=int, default=16)
    parser.add_argument("--positions", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=2048)
    args = parser.parse_args()
    depths = [int(d) for d in args.depths.split(",")]
    rates: dict[int, list[float]] = {d: [] for d in depths}
    for _ in range(args.rounds):
        for depth in depths:
            rates[depth].append(handoff_mb_s(args, depth))
            print(f"depth {depth}: {rates[depth][-1]:.0f} MB/s", flush=True)
    print(f"\n{args.requests} requests x {args.sites * args.positions * args.hidden * 2 / 1e6:.0f} MB to "
          f"{args.layout} under {args.root}\n\n| requests in flight | MB/s per round | median |\n|---|---|---|")
    for depth, values in rates.items():
        print(f"| {depth} | {' / '.join(f'{v:.0f}' for v in values)} | {statistics.median(values):.0f} |")
    print(f"\nplain synced write of 256 MB to {args.root}: {plain_write_mb_s(args.root):.0f} MB/s")


if __name__ == "__main__":
    main()
