"""How fast finished requests' rows reach a consumer in its own process, and where the time goes on each side.

    python -m benchmarks.consumer_handoff [--root DIR] [--layout sharded] [--requests 64] [--depths 1,2,4]
        [--rounds 2] [--sites 16] [--positions 512] [--hidden 2048] [--child-threads consumer,N]

Feeds ``--requests`` captures of ``sites x positions x hidden`` bf16 rows (32 MB each by default; 128 positions
make the sharded layout's 8 MiB parts) through ``ConsumerRunner(InProcess(FilesystemConsumer))`` writing under
a fresh directory in ``--root`` (a disk, or ``/dev/shm`` to take the disk out), with
``isolation.PIPELINE_DEPTH`` set to each of ``--depths`` in turn, in rounds (A B C A B C). Per depth it prints
the steady rate (MB/s from the first quarter of the requests' answers to the last, so neither the first
fault-in of fresh blocks and shard buffers nor the child's exit counts) and where the time went: the runner
thread's gather into shared blocks, and the child's ``consume`` and its waits for the shard writers, each as a
share of that span. Then a plain synced write of 256 MB to the same root, for
scale. No engine: the gather is one ``torch.cat`` of per-position chunks, as the store's is.
``--child-threads consumer,16`` compares the consumer's own ``process_threads`` with 16 torch threads.
"""

import argparse
import itertools
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

CHILD_THREADS_ENV = "VLLM_INTERP_HANDOFF_CHILD_THREADS"


class TimedFilesystem(FilesystemConsumer):
    """The filesystem consumer, timing its own work in the child: each result carries the running totals."""

    def __init__(self, context: ConsumerContext) -> None:
        super().__init__(context)
        if os.environ.get(CHILD_THREADS_ENV):
            torch.set_num_threads(int(os.environ[CHILD_THREADS_ENV]))
        self.seconds = {"consume": 0.0, "writer wait": 0.0}
        self.wait_written = self._timed(self.wait_written, "writer wait")

    def _timed(self, call, key: str):
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self.seconds[key] += time.perf_counter() - started
        return timed

    def consume(self, capture):
        started = time.perf_counter()
        result = super().consume(capture)
        self.seconds["consume"] += time.perf_counter() - started
        return {**result, "seconds": dict(self.seconds)}


def handoff(args: argparse.Namespace, depth: int) -> tuple[float, dict[str, float]]:
    """The steady MB/s at ``depth`` requests in flight, and each side's busy share of that span."""
    isolation.PIPELINE_DEPTH = depth
    root = tempfile.mkdtemp(dir=args.root)
    options = TimedFilesystem.validate_engine_options({"root": root, "layout": args.layout})
    context = ConsumerContext("filesystem", options, "m", num_layers=args.sites, hidden_size=args.hidden)
    runner = ConsumerRunner(isolation.InProcess(TimedFilesystem, context), policy="block", queue_bytes=16 << 30)
    chunks = [torch.randn(args.sites, 1, args.hidden).to(torch.bfloat16) for _ in range(args.positions)]
    sites = [f"{layer}.post_block" for layer in range(args.sites)]
    gathers: list[float] = []
    answered: list[float] = []

    def gather(block: torch.Tensor) -> None:
        started = time.perf_counter()
        torch.cat(chunks, dim=1, out=block)
        gathers.append(time.perf_counter() - started)

    try:
        futures = [runner.submit(PendingCapture(
            CaptureMeta(request_id=f"r{i}", tag=None, model="m", prompt_len=1, positions=list(range(args.positions)),
                        sites=sites, dtype="bfloat16"), args.hidden, torch.bfloat16, gather),
            ConsumerResult(status="ok", rows=args.positions * args.sites)) for i in range(args.requests)]
        for future in futures:
            future.add_done_callback(lambda _: answered.append(time.perf_counter()))
        results = [future.result() for future in futures]
        assert all(r.status == "ok" for r in results), results[0]
    finally:
        runner.close()
        shutil.rmtree(root)
    first = args.requests // 4
    span = answered[-1] - answered[first]
    request_mb = args.sites * args.positions * args.hidden * 2 / 1e6
    child = {key: results[-1].result["seconds"][key] - results[first].result["seconds"][key]
             for key in results[-1].result["seconds"]}
    shares = {"gather": sum(gathers[first + 1:]) / span, **{f"child {key}": v / span for key, v in child.items()}}
    return (args.requests - 1 - first) * request_mb / span, shares


def plain_write_mb_s(root: str, nbytes: int = 256 << 20, chunk: memoryview | None = None) -> float:
    """MB/s of one synced write of ``nbytes`` to a file under ``root``: random bytes in one call, or ``chunk``
    written again and again."""
    chunk = chunk if chunk is not None else memoryview(os.urandom(nbytes))
    fd, path = tempfile.mkstemp(dir=root)
    try:
        started = time.perf_counter()
        for _ in range(nbytes // chunk.nbytes):
            os.write(fd, chunk)
        os.fsync(fd)
        return nbytes / 1e6 / (time.perf_counter() - started)
    finally:
        os.close(fd)
        os.unlink(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", default=tempfile.gettempdir())
    parser.add_argument("--layout", default="sharded", choices=("sharded", "packed", "per_file"))
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--depths", default="1,2,4")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--sites", type=int, default=16)
    parser.add_argument("--positions", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--child-threads", default="consumer",
                        help="torch's thread counts in the consumer's process to compare: 'consumer' (its "
                             "process_threads) or a number")
    args = parser.parse_args()
    configs = list(itertools.product([int(d) for d in args.depths.split(",")], args.child_threads.split(",")))
    rates: dict[tuple[int, str], list[float]] = {config: [] for config in configs}
    for _ in range(args.rounds):
        for depth, threads in configs:
            os.environ.pop(CHILD_THREADS_ENV, None)
            if threads != "consumer":
                os.environ[CHILD_THREADS_ENV] = threads
            rate, shares = handoff(args, depth)
            rates[depth, threads].append(rate)
            print(f"depth {depth}, child threads {threads}: {rate:.0f} MB/s; busy share of the span: "
                  + ", ".join(f"{key} {share:.2f}" for key, share in shares.items()), flush=True)
    print(f"\n{args.requests} requests x {args.sites * args.positions * args.hidden * 2 / 1e6:.0f} MB to "
          f"{args.layout} under {args.root}\n\n| requests in flight | child threads | steady MB/s per round | median |"
          "\n|---|---|---|---|")
    for (depth, threads), values in rates.items():
        print(f"| {depth} | {threads} | {' / '.join(f'{v:.0f}' for v in values)} | {statistics.median(values):.0f} |")
    print(f"\nplain synced write of 256 MB to {args.root}: {plain_write_mb_s(args.root):.0f} MB/s")


if __name__ == "__main__":
    # Run under the module's own name: the consumer's process unpickles TimedFilesystem from there, not __main__.
    from benchmarks.consumer_handoff import main as handoff_main

    handoff_main()
