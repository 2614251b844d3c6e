"""Consumers in a process of their own (``isolation=process``): rows through shared memory, results and
failures back, start-up errors at start-up, a dead child failing its requests only, and a child whose worker
went away publishing what it buffered. Real child processes, no engine. And in the worker (``isolation=thread``):
its block memory reused, except what a consumer keeps or a failure may hold."""

import errno
import json
import os
import signal
import threading
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from vllm_interp.capture import isolation
from vllm_interp.capture.consumer import (
    CaptureConsumer,
    CaptureMeta,
    ConsumerContext,
    PendingCapture,
    RequestCapture,
)
from vllm_interp.capture.consumers.filesystem import FilesystemConsumer, list_captures, read_capture
from vllm_interp.capture.consumers.logging import STATS, LoggingConsumer, row_statistics, stats_lists
from vllm_interp.capture.dispatch import ConsumerRunner
from vllm_interp.capture.isolation import PIPELINE_DEPTH, InProcess, InThread
from vllm_interp.capture.plugins import configure_consumers
from vllm_interp.capture.results import ConsumerResult

HIDDEN = 16
SITES = ["0.pre_attn", "3.post_block"]
WAIT_S = 60


def capture(request_id: str, positions: int = 5, tag: str | None = None,
            dtype: torch.dtype = torch.float32) -> RequestCapture:
    generator = torch.Generator().manual_seed(len(request_id))
    meta = CaptureMeta(request_id=request_id, tag=tag, model="m", prompt_len=positions,
                       positions=list(range(positions)), sites=SITES, dtype=str(dtype).removeprefix("torch."))
    return RequestCapture(meta, {s: torch.randn(positions, HIDDEN, generator=generator).to(dtype) for s in SITES})


def summaries(rows: RequestCapture) -> RequestCapture:
    """What the worker hands the logging consumer for ``rows``: each row's statistics, reduced as steps run."""
    return RequestCapture(replace(rows.meta, dtype="float32"), {s: row_statistics(t) for s, t in rows})


def context(name: str, **options) -> ConsumerContext:
    return ConsumerContext(name=name, options=options, model="m", num_layers=4, hidden_size=HIDDEN)


def submit(runner: ConsumerRunner, rows: RequestCapture) -> ConsumerResult:
    base = ConsumerResult(status="ok", rows=len(rows.meta.positions) * len(rows.meta.sites))
    return runner.submit(PendingCapture.of(rows), base).result(WAIT_S)


def leftover_blocks(host: InProcess) -> set[str]:
    """Shared blocks in the host's directory other than the spare ones it reuses."""
    return {str(p) for p in host._dir.iterdir()} - {block.path for block in host._spare}


def filesystem_options(root: Path, **extra) -> dict:
    return FilesystemConsumer.validate_engine_options({"root": str(root), **extra})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logging_in_a_process_returns_what_it_returns_in_the_worker(dtype):
    options = LoggingConsumer.validate_engine_options({})
    runner = ConsumerRunner(InProcess(LoggingConsumer, context("logging", **options)), policy="block",
                            queue_bytes=1 << 20)
    try:
        rows = capture("req-1", dtype=dtype)
        result = submit(runner, summaries(rows))
        assert result.status == "ok"
        expected = {"rows": 10, "stats": {s: stats_lists(row_statistics(rows.tensors[s])) for s in SITES}}
        assert LoggingConsumer.result_from_wire(result.result) == expected
        # A request without rows travels without a shared block.
        assert LoggingConsumer.result_from_wire(submit(runner, summaries(capture("req-2", positions=0))).result) == {
            "rows": 0, "stats": {s: {key: [] for key in STATS} for s in SITES}}
        assert not leftover_blocks(runner.host), "a request's shared block outlived it"
    finally:
        runner.close()
    assert not runner.host._dir.exists()


def test_filesystem_in_a_process_writes_and_reports_failures(tmp_path):
    runner = ConsumerRunner(InProcess(FilesystemConsumer, context("filesystem", **filesystem_options(tmp_path))),
                            policy="block", queue_bytes=1 << 20)
    try:
        rows = capture("req-1", tag="run/a", dtype=torch.bfloat16)
        written = submit(runner, rows)
        assert written.status == "ok" and written.result["base"] == "run/a"
        tensors, meta = read_capture(tmp_path, "run/a")
        assert meta["positions"] == list(range(5))
        for site in SITES:
            assert torch.equal(tensors[site], rows.tensors[site])
        again = submit(runner, rows)  # the collision policy refuses: only this request fails, as in the worker
        assert again.status == "error" and again.message.startswith("FileExistsError: capture 'run/a' already")
        # The child answered that it keeps nothing of the failed request's block: it is reused, not given up.
        assert [block.size for block in runner.host._spare] == [2 << 20] and not leftover_blocks(runner.host)
        assert submit(runner, capture("req-2", tag="run/b")).status == "ok"
    finally:
        runner.close()


def test_blocks_are_reused_and_rows_are_never_stale():
    options = LoggingConsumer.validate_engine_options({})
    host = InProcess(LoggingConsumer, context("logging", **options))
    try:
        for depth in (1, PIPELINE_DEPTH):  # one request at a time, then as many in flight as the host allows
            requests = [summaries(capture(f"req-{depth}-{i}" + "x" * i, positions=3 + i)) for i in range(8)]
            futures, used = [], set()
            for rows in requests:
                futures.append(host.submit(PendingCapture.of(rows)))
                used |= {block.path for _, _, block in host._in_flight}
                if depth == 1:
                    host.settle()
            host.settle()
            for rows, future in zip(requests, futures, strict=True):
                stats = LoggingConsumer.result_from_wire(future.result())["stats"]
                assert stats == {s: stats_lists(rows.tensors[s]) for s in SITES}
            assert len(used) <= depth, "a block per request instead of reused ones"
            assert not leftover_blocks(host)
    finally:
        host.close()


def test_a_small_request_leaves_the_large_spare_for_the_next_large_one():
    """A bulk sink's parts come in sizes from a small final part to a prompt's chunk: each takes a spare that
    serves it, and a small one neither throws away nor resizes the large spare a later large part needs."""
    host = InProcess(LoggingConsumer, context("logging", **LoggingConsumer.validate_engine_options({})))
    try:
        def submit_settled(name: str, positions: int) -> None:
            host.submit(PendingCapture.of(summaries(capture(name, positions=positions))))
            host.settle()

        submit_settled("large", 300_000)
        big_block = host._spare[0]
        assert big_block.size == 12 << 20
        submit_settled("small", 5)
        assert sorted(b.size for b in host._spare) == [2 << 20, 12 << 20] and host.blocks_made == 2
        submit_settled("large-again", 290_000)
        assert host.blocks_made == 2 and big_block in host._spare and big_block.size == 12 << 20
        assert not leftover_blocks(host)
    finally:
        host.close()


def test_spares_past_their_limit_are_given_up_oldest_first(monkeypatch):
    """A burst of large requests leaves no more than ``SPARE_MAX_BYTES`` of blocks behind."""
    monkeypatch.setattr(isolation, "SPARE_MAX_BYTES", 8 << 20)
    host = InProcess(LoggingConsumer, context("logging", **LoggingConsumer.validate_engine_options({})))
    try:
        futures = [host.submit(PendingCapture.of(summaries(capture(f"req-{i}", positions=100_000))))
                   for i in range(PIPELINE_DEPTH)]  # all in flight: a block each (4 MiB), answered together
        blocks = [block for _, _, block in host._in_flight]
        host.settle()
        assert all(future.result()["rows"] == 200_000 for future in futures)
        assert host._spare == blocks[-2:] and not any(os.path.exists(b.path) for b in blocks[:-2])
        host.submit(PendingCapture.of(summaries(capture("larger", positions=300_000))))
        host.settle()  # its 12 MiB block is over the limit alone
        assert host._spare == blocks[-2:] and host.blocks_made == PIPELINE_DEPTH + 1
        assert not leftover_blocks(host)
    finally:
        host.close()


def test_a_block_the_child_cannot_map_fails_that_request_only():
    blocks = isolation._ChildBlocks()
    consumer = LoggingConsumer(context("logging", **LoggingConsumer.validate_engine_options({})))
    rows = summaries(capture("req-1"))
    shape = (len(SITES), 5, rows.tensors[SITES[0]].shape[-1])
    status, message, kept = isolation._consume(consumer, blocks, rows.meta, "/dev/shm/no-such-block", 2 << 20,
                                               shape, torch.float32, [])
    assert (status, kept) == ("error", False) and message.startswith("FileNotFoundError")


class KeepingConsumer(CaptureConsumer):
    """Keeps every request's tensors past ``consume`` and reports the sums of all it kept."""

    def __init__(self, context: ConsumerContext) -> None:
        super().__init__(context)
        self.kept: list[torch.Tensor] = []

    def consume(self, capture: RequestCapture) -> dict:
        self.kept.append(capture.tensors[SITES[0]])
        return {"sums": [float(t.sum()) for t in self.kept]}


def test_a_consumer_that_keeps_rows_keeps_them_intact():
    """The child sees that the consumer still holds the block, and the worker lends it rather than reuse it."""
    host = InProcess(KeepingConsumer, context("keeping"))
    try:
        requests = [capture(f"req-{i}" + "x" * i) for i in range(4)]
        sums = []
        for i, rows in enumerate(requests):
            future = host.submit(PendingCapture.of(rows))
            host.settle()
            sums.append(float(rows.tensors[SITES[0]].sum()))
            assert future.result()["sums"] == pytest.approx(sums, rel=1e-6)
            assert not host._spare and len(host._lent) == i + 1 == len(list(host._dir.iterdir()))
    finally:
        host.close()


class LettingGoConsumer(KeepingConsumer):
    """Keeps rows until a request tagged ``let-go``, which drops everything kept (and its own rows)."""

    def consume(self, capture: RequestCapture) -> dict:
        if capture.meta.tag == "let-go":
            self.kept.clear()
            return {"sums": []}
        return super().consume(capture)


def test_a_block_the_consumer_lets_go_of_comes_back_and_is_reused():
    host = InProcess(LettingGoConsumer, context("letting-go"))
    try:
        for i in range(2):
            host.submit(PendingCapture.of(capture(f"req-{i}")))
            host.settle()
        lent = set(host._lent)
        assert len(lent) == 2 and not host._spare
        host.submit(PendingCapture.of(capture("drop", tag="let-go")))
        host.settle()
        # The answer to the request that let go lists the two lent blocks: spares now, with its own block.
        assert not host._lent and lent < {block.path for block in host._spare} and len(host._spare) == 3
        rows = capture("req-again" + "x" * 7)
        future = host.submit(PendingCapture.of(rows))
        host.settle()
        assert future.result()["sums"] == pytest.approx([float(rows.tensors[SITES[0]].sum())], rel=1e-6)
        assert len(list(host._dir.iterdir())) == 3, "a fresh block instead of a spare"
    finally:
        host.close()


def test_past_the_lent_limit_the_oldest_block_is_given_up_and_its_rows_stay(monkeypatch):
    monkeypatch.setattr(isolation, "MAX_LENT_BLOCKS", 2)
    host = InProcess(KeepingConsumer, context("keeping"))
    try:
        sums = []
        for i in range(4):
            rows = capture(f"req-{i}" + "x" * i)
            future = host.submit(PendingCapture.of(rows))
            host.settle()
            sums.append(float(rows.tensors[SITES[0]].sum()))
            # Given-up blocks' rows live on in the child's mappings, unchanged by later requests.
            assert future.result()["sums"] == pytest.approx(sums, rel=1e-6)
        assert len(host._lent) == 2 == len(list(host._dir.iterdir())) and not host._spare
    finally:
        host.close()


def test_in_the_worker_memory_is_reused_and_rows_are_never_stale():
    host = InThread(LoggingConsumer(context("logging", **LoggingConsumer.validate_engine_options({}))))
    memories = []
    for i in range(6):
        rows = summaries(capture(f"req-{i}" + "x" * i, positions=3 + i))
        stats = LoggingConsumer.result_from_wire(host.submit(PendingCapture.of(rows)).result())["stats"]
        assert stats == {s: stats_lists(rows.tensors[s]) for s in SITES}
        memories.append(host._spare)
    # The first request's memory is its exact size (the consumer might keep it); then one block serves all.
    assert memories[0].size == PendingCapture.of(summaries(capture("req-0", positions=3))).nbytes
    assert all(m is memories[1] for m in memories[1:]) and memories[1].size == isolation.BLOCK_GRAIN


def test_in_the_worker_a_consumer_that_keeps_rows_keeps_them_intact_at_their_size():
    host = InThread(KeepingConsumer(context("keeping")))
    sums = []
    for i in range(4):
        rows = capture(f"req-{i}" + "x" * i)
        sums.append(float(rows.tensors[SITES[0]].sum()))
        assert host.submit(PendingCapture.of(rows)).result()["sums"] == pytest.approx(sums, rel=1e-6)
        assert host._spare is None and not host._reuse
    # Each kept request holds memory of its own size, not a reusable block's.
    assert [t.untyped_storage().nbytes() for t in host.consumer.kept] == [PendingCapture.of(capture("r")).nbytes] * 4


class FailingConsumer(CaptureConsumer):
    def consume(self, capture: RequestCapture) -> dict:
        if capture.meta.request_id == "fails":
            raise ValueError("refused")
        return {"first": float(capture.tensors[SITES[0]][0, 0])}


def test_in_the_worker_a_failed_requests_memory_is_not_reused():
    """Its exception's traceback may hold the rows; the request after it gets fresh memory and its own rows."""
    host = InThread(FailingConsumer(context("failing")))
    with pytest.raises(ValueError, match="refused"):
        host.submit(PendingCapture.of(capture("fails"))).result()
    assert host._spare is None
    rows = capture("next")
    assert host.submit(PendingCapture.of(rows)).result() == {"first": float(rows.tensors[SITES[0]][0, 0])}
    assert host._spare is not None and host._reuse


def test_a_constructor_error_fails_at_start_naming_the_consumer(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(RuntimeError, match=r"capture consumer filesystem: (FileExistsError|NotADirectoryError)"):
        InProcess(FilesystemConsumer, context("filesystem", **{**filesystem_options(tmp_path),
                                                               "root": str(blocker / "below")}))


def test_a_dead_child_fails_later_requests_and_the_runner_goes_on():
    options = LoggingConsumer.validate_engine_options({})
    runner = ConsumerRunner(InProcess(LoggingConsumer, context("logging", **options)), policy="block",
                            queue_bytes=1 << 20)
    try:
        assert submit(runner, summaries(capture("req-1"))).status == "ok"
        os.kill(runner.host._process.pid, signal.SIGKILL)
        runner.host._process.wait(WAIT_S)
        failed = submit(runner, summaries(capture("req-2")))
        assert failed.status == "error" and failed.dropped == 10
        assert "capture consumer logging: its process exited (-9) while consuming request req-2" in failed.message
        assert not leftover_blocks(runner.host)
    finally:
        with pytest.raises(RuntimeError, match="its process exited"):
            runner.close()


def test_requests_are_handed_on_before_the_child_answers_and_answered_in_order():
    host = InProcess(LoggingConsumer, context("logging", **LoggingConsumer.validate_engine_options({})))
    try:
        futures = [host.submit(PendingCapture.of(summaries(capture(f"req-{i}", positions=i + 1))))
                   for i in range(PIPELINE_DEPTH + 1)]
        # The last submit made room by taking the oldest answer; the others stay with the child until settled.
        assert [f.done() for f in futures] == [True] + [False] * PIPELINE_DEPTH
        host.settle()
        assert [f.result()["rows"] for f in futures] == [2 * (i + 1) for i in range(PIPELINE_DEPTH + 1)]
        assert not leftover_blocks(host)
        # A child that dies with requests in flight (stopped first, so that it answers none) fails each of them.
        os.kill(host._process.pid, signal.SIGSTOP)
        futures = [host.submit(PendingCapture.of(summaries(capture(f"late-{i}")))) for i in range(2)]
        os.kill(host._process.pid, signal.SIGKILL)
        host.settle()
        for future in futures:
            with pytest.raises(RuntimeError, match="its process exited"):
                future.result()
        assert not leftover_blocks(host)
    finally:
        with pytest.raises(RuntimeError, match="its process exited"):
            host.close()


def test_large_requests_with_large_answers_in_flight_do_not_wait_on_each_other():
    """A 100,000-position request's metadata and its ``logging`` answer both outgrow the socket's buffer: the
    worker sending the next request while the child sends an answer must not leave both waiting for good."""
    host = InProcess(LoggingConsumer, context("logging", **LoggingConsumer.validate_engine_options({})))
    futures = []

    def submit_all() -> None:
        futures.extend(host.submit(PendingCapture.of(summaries(capture(f"long-{i}", positions=100_000))))
                       for i in range(PIPELINE_DEPTH + 1))
        host.settle()

    submitting = threading.Thread(target=submit_all, daemon=True)
    submitting.start()
    submitting.join(WAIT_S)
    try:
        assert not submitting.is_alive(), "the worker and its consumer's process wait on each other"
        assert [future.result()["rows"] for future in futures] == [200_000] * (PIPELINE_DEPTH + 1)
    finally:
        if submitting.is_alive():
            host._process.kill()  # frees the worker's send, so the thread ends
            submitting.join(WAIT_S)
        else:
            host.close()


def test_a_child_whose_worker_is_gone_publishes_its_buffered_shard(tmp_path):
    """The socket closing (the worker died) makes the child close its consumer: a sharded layout's buffer is
    published rather than lost."""
    host = InProcess(FilesystemConsumer, context("filesystem", **filesystem_options(tmp_path, layout="sharded")))
    rows = capture("req-1", tag="kept")
    written = host.submit(PendingCapture.of(rows))
    host.settle()
    assert written.result()["pending"] is True
    host._conn.close()
    assert host._process.wait(WAIT_S) == 0
    assert list_captures(tmp_path) == ["kept"]
    index = (tmp_path / "shards" / "index.jsonl").read_text().splitlines()
    assert [json.loads(line)["base"] for line in index] == ["kept"]


def test_isolation_defaults_and_option():
    setups = configure_consumers(("logging", "inline", "filesystem:root=/tmp/x"))
    assert [s.isolation for s in setups.values()] == ["thread", "thread", "process"]
    setups = configure_consumers(("logging:isolation=process", "filesystem:root=/tmp/x,isolation=thread"))
    assert [s.isolation for s in setups.values()] == ["process", "thread"]
    assert "isolation" not in setups["filesystem"].options
    with pytest.raises(ValueError, match="--capture-consumers logging: isolation: expected one of thread, process"):
        configure_consumers(("logging:isolation=fork",))


def test_no_room_in_shared_memory_fails_only_that_request(monkeypatch):
    options = LoggingConsumer.validate_engine_options({})
    runner = ConsumerRunner(InProcess(LoggingConsumer, context("logging", **options)), policy="block",
                            queue_bytes=1 << 20)
    try:
        real = os.posix_fallocate

        def full(fd, offset, length):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(os, "posix_fallocate", full)
        failed = submit(runner, summaries(capture("req-1")))
        assert failed.status == "error" and "no room for a 2 MiB block of rows" in failed.message
        assert "No space left" in failed.message
        monkeypatch.setattr(os, "posix_fallocate", real)
        assert submit(runner, summaries(capture("req-2"))).status == "ok"
        assert not leftover_blocks(runner.host)
    finally:
        runner.close()


class ThreadCounting(CaptureConsumer):
    """Answers with torch's thread count where it runs."""

    name = "thread_counting"
    process_threads = 1

    def consume(self, capture: RequestCapture) -> dict:
        return {"threads": torch.get_num_threads()}


class ThreadCountingAtDefault(ThreadCounting):
    process_threads = None


def test_a_consumer_process_runs_torch_on_the_threads_its_class_asks_for():
    counts = {}
    for cls in (ThreadCounting, ThreadCountingAtDefault):
        host = InProcess(cls, context(cls.name))
        try:
            answer = host.submit(PendingCapture.of(capture("req")))
            host.settle()
            counts[cls.process_threads] = answer.result()["threads"]
        finally:
            host.close()
    assert counts == {1: 1, None: torch.get_num_threads()}
    assert FilesystemConsumer.process_threads == 1
