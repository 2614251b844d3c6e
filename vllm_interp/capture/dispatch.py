"""Running a consumer off the forward path: one thread and one bounded queue per consumer.

The thread gathers each queued request's rows (``PendingCapture.fill``) and hands them to the consumer's
host: the consumer itself on this thread, or its own process (``isolation.py``), which may still be
consuming the previous request while this thread gathers the next. A request's result (and its room in the
queue) comes when its host answers; with nothing queued the thread waits for every answer outstanding.

A finished request's rows go ahead of running requests' parts (``CaptureConsumer.part_bytes``), with that
request's own parts still queued, in order: its stream's last chunk waits for its results, while a running
request's parts hold no one up. First come, first served, a bulk sink's finished requests waited behind the
backlog of everyone's parts (H200 host, every-token capture to the ``sharded`` layout: 190-340 ms a request,
its closed-loop client idle meanwhile).

The queue is bounded in bytes (``queue_mb``). When a finished request's rows (or a part's) do not fit, the
engine-wide ``--capture-overload-policy`` decides:

- ``block``: the worker waits for the consumer (decoding stalls; nothing is lost), at most
  ``BLOCK_TIMEOUT_S``: a consumer that makes no room in that time is taken as stalled, and the request's rows
  are dropped for it with an error saying so (the engine keeps serving; other consumers are not affected);
- ``drop``: the request's rows are dropped for this consumer; its result is an ``error`` that counts them;
- ``spill``: the rows wait in a safetensors file under ``spill_dir`` and are consumed, in order, later; the
  result counts them as ``spilled``.

The threads share the worker's interpreter lock with the forward loop, which gives it up and takes it back
around every tensor op it launches (1,500 and more a step). A consumer thread busy beside that loop makes each
of those handoffs wait: on the dev CPU a loop of 1,500 small ops took 4.7 ms alone and 9-19 ms beside a runner
consuming 32 ``inline`` requests (about 10 ms of work on its thread), 4.8 ms with the gate closed around it
(``benchmarks/host_costs.py``). So a runner takes its next request only while the worker is not launching a
forward (``FORWARD``, which the runner mixins close around it) nor handing finished requests on (the store closes
it around that): between steps, and while the engine waits for the device, as a GPU engine mostly does. Let in,
it takes the finished requests queued then too, within a byte budget: a wave that ends together is handed on
in one turn, not one request per opening of the gate.
"""

import logging
import os
import tempfile
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import load_file, save_file

from vllm_interp.capture.consumer import PendingCapture, RequestCapture
from vllm_interp.capture.isolation import ConsumerProcessError, InProcess, InThread
from vllm_interp.capture.results import ConsumerResult

logger = logging.getLogger(__name__)

OverloadPolicy = Literal["block", "drop", "spill"]
BLOCK_TIMEOUT_S = 60.0
# Torch's thread count on a runner thread. Its copies (a request's rows gathered into the consumer's block, an
# in-thread consumer's work) are off the forward path and need no more: at a thread per core, torch splits each
# large copy across the engine process's intra-op pool, whose threads then spin for work on the cores the
# forward loop and the consumer's process need (H200 host, a sink phase of every-token capture: the engine's
# other threads waited 539 ms for a CPU at 16, 2 ms at 1; the sink 0.37-0.41 of plain throughput against
# 0.42-0.50, two servers one after the other). vLLM gives its multi-GPU workers one thread for the same reason.
RUNNER_TORCH_THREADS = 1
# The most bytes of finished requests' rows a runner takes at one opening of the gate (``ConsumerRunner._take``):
# a wave of requests' summaries (64 every-token requests at 16 sites: 5 MiB) at once, a bulk sink's rows a
# request at a time, as before.
BATCH_BYTES = 8 << 20


class ForwardGate:
    """Open unless the worker's forward thread is launching a forward, or handing finished requests to their
    consumers (``launching``, which nests: the store hands requests on within a step too); consumer runners take
    work only while it is open. The worker's own wait for a consumer (``waiting``) opens it, so that the wait
    can end. Only the forward thread enters it."""

    def __init__(self) -> None:
        self._open = threading.Event()
        self._open.set()
        self._depth = 0

    @contextmanager
    def launching(self) -> Iterator[None]:
        self._depth += 1
        self._open.clear()
        try:
            yield
        finally:
            self._depth -= 1
            if not self._depth:
                self._open.set()

    @contextmanager
    def waiting(self) -> Iterator[None]:
        was_open = self._open.is_set()
        self._open.set()
        try:
            yield
        finally:
            if not was_open:
                self._open.clear()

    def wait_open(self) -> None:
        self._open.wait()


FORWARD = ForwardGate()  # the worker process's forward loop (one per process)


@dataclass
class _Job:
    capture: PendingCapture
    result: ConsumerResult  # status and counts so far; the consumer's outcome completes it
    future: Future
    spill_path: Path | None = None

    @property
    def queued_bytes(self) -> int:
        return 0 if self.spill_path is not None else self.capture.nbytes


class ConsumerRunner:
    """Feeds one consumer (through its host) from a queue on its own thread."""

    def __init__(self, host: InThread | InProcess, *, policy: OverloadPolicy, queue_bytes: int,
                 spill_dir: str | None = None, block_timeout_s: float = BLOCK_TIMEOUT_S,
                 gate: ForwardGate = FORWARD) -> None:
        self.host = host
        self.gate = gate
        self.consumer_class = host.consumer_class
        self.row_reduction = host.consumer_class.row_reduction  # what the store hands it: rows or their summaries
        self.policy = policy
        self.queue_bytes = queue_bytes
        self.block_timeout_s = block_timeout_s
        self._spill_dir = Path(spill_dir) if spill_dir else None
        self._finished: deque[_Job] = deque()  # finished requests' jobs, taken first
        self._running: deque[_Job] = deque()  # running requests' parts
        self._closing = False
        self._queued = 0
        self._spills = 0
        self._cond = threading.Condition()
        self._thread = _start_with_torch_threads(self._run, RUNNER_TORCH_THREADS,
                                                 name=f"vllm-interp-capture-{host.context.name}")

    def part_bytes(self, request_options: dict[str, Any]) -> int:
        """The size of the parts a request with these consumer options is handed on in (0: whole)."""
        return self.consumer_class.part_bytes({**self.host.context.options, **request_options})

    def submit(self, capture: PendingCapture, result: ConsumerResult) -> Future:
        """Queue a finished request (or a part of one); the future resolves to its ``ConsumerResult``."""
        job = _Job(capture, result, Future())
        with self._cond:
            if self._queued and self._queued + capture.nbytes > self.queue_bytes:
                if self.policy == "spill":
                    self._spill(job)
                elif self.policy == "drop" or not self._wait_for_room(capture.nbytes):
                    job.future.set_result(self._dropped(result))
                    return job.future
            self._queued += job.queued_bytes
            self._queue(job)
            self._cond.notify_all()
        return job.future

    def _queue(self, job: _Job) -> None:
        """A running request's part joins the running ones; a final one goes ahead of them (see the module
        docstring), with its request's parts still queued."""
        if not job.capture.meta.final:
            self._running.append(job)
            return
        request_id, others = job.capture.meta.request_id, deque()
        for queued in self._running:
            (self._finished if queued.capture.meta.request_id == request_id else others).append(queued)
        self._running = others
        self._finished.append(job)

    def _wait_for_room(self, nbytes: int) -> bool:
        """The ``block`` policy's wait (holding ``_cond``), with the gate open: the worker may be in a step."""
        with self.gate.waiting():
            return self._cond.wait_for(lambda: not self._queued or self._queued + nbytes <= self.queue_bytes,
                                       timeout=self.block_timeout_s)

    def _dropped(self, result: ConsumerResult) -> ConsumerResult:
        name, queued, limit = self.host.context.name, self._queued >> 20, self.queue_bytes >> 20
        why = (f"overload policy {self.policy}" if self.policy == "drop" else
               f"it made no room in {self.block_timeout_s:g} s (stalled?), overload policy block")
        return ConsumerResult.failed(
            f"dropped {result.rows} rows: the {name} consumer's queue is full ({queued} MiB queued, "
            f"queue_mb={limit}); {why}", dropped=result.rows)

    def close(self) -> None:
        """Consume everything queued, then close the consumer."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join()
        self.host.close()

    def _spill(self, job: _Job) -> None:
        if self._spill_dir is None:
            self._spill_dir = Path(tempfile.mkdtemp(prefix="vllm-interp-spill-"))
        self._spill_dir.mkdir(parents=True, exist_ok=True)
        self._spills += 1
        path = self._spill_dir / f"{self.host.context.name}-{os.getpid()}-{self._spills}.safetensors"
        pending = job.capture
        block = torch.empty(pending.shape, dtype=pending.dtype)
        pending.fill(block)
        save_file({site: t.contiguous() for site, t in RequestCapture.of_block(pending.meta, block)}, str(path))

        def load(out: torch.Tensor) -> None:
            # ``of`` takes the tensors in site order (the file keeps them in name order).
            PendingCapture.of(RequestCapture(pending.meta, load_file(path))).fill(out)

        job.capture = PendingCapture(pending.meta, pending.hidden, pending.dtype, load)
        job.spill_path = path
        job.result = job.result.model_copy(update={"spilled": job.result.rows})

    def _run(self) -> None:
        while True:
            with self._cond:
                idle = not (self._finished or self._running)
            if idle:
                self.host.settle()  # nothing to gather meanwhile: collect what the host still owes
            with self._cond:
                self._cond.wait_for(lambda: bool(self._finished or self._running) or self._closing)
                if not (self._finished or self._running):
                    break  # closing, and everything is handed on
            self.gate.wait_open()
            for job in self._take():
                self._hand(job)
        self.host.settle()

    def _take(self) -> list[_Job]:
        """The jobs to hand on at one opening of the gate: the next one, and after it the finished requests'
        queued then, up to ``BATCH_BYTES``. A wave of requests ends together: taken one per opening, each
        waited for the gate and then for the interpreter lock, the forward thread's to give up (H100 host, 64
        every-token requests to ``logging`` ending in one step: 77-115 ms from hand-on to result, a request,
        for about 10 ms of the runner's work a wave)."""
        with self._cond:
            jobs = [(self._finished or self._running).popleft()]
            taken = jobs[0].queued_bytes
            while self._finished and taken + self._finished[0].queued_bytes <= BATCH_BYTES:
                jobs.append(self._finished.popleft())
                taken += jobs[-1].queued_bytes
        return jobs

    def _hand(self, job: _Job) -> None:
        try:
            outcome = self.host.submit(job.capture)
        except Exception as exc:  # the rows could not be gathered or sent
            outcome = Future()
            outcome.set_exception(exc)
        # Resolved on this thread: at once (in the worker), or when the child answers.
        outcome.add_done_callback(lambda done, job=job: self._finish(job, done))

    def _finish(self, job: _Job, outcome: Future) -> None:
        if job.spill_path is not None:
            job.spill_path.unlink(missing_ok=True)
        result = self._result(job, outcome)
        # Room first, then the result: a caller that sees the result may submit again at once.
        with self._cond:
            self._queued -= job.queued_bytes
            self._cond.notify_all()
        job.future.set_result(result)

    def _result(self, job: _Job, outcome: Future) -> ConsumerResult:
        exc = outcome.exception()
        if exc is None:
            return job.result.model_copy(update={"result": outcome.result()})
        # A consumer's failure is its request's result, never the engine's.
        message = str(exc) if isinstance(exc, ConsumerProcessError) else f"{type(exc).__name__}: {exc}"
        logger.warning("capture consumer %s failed on request %s: %s", self.host.context.name,
                       job.capture.meta.request_id, message)
        return ConsumerResult.failed(message, dropped=job.result.rows)


def _start_with_torch_threads(target: Callable[[], None], threads: int, name: str) -> threading.Thread:
    """Start a daemon thread that runs ``target`` with torch at ``threads`` intra-op threads, leaving every
    other thread's count, and the count threads started later begin with, as they were. Torch keeps a
    thread's count per thread (OpenMP's), set from a process-wide default on the thread's first query;
    ``torch.set_num_threads`` sets both. So the new thread settles its own count before it changes it, and
    this one then sets the default back (tests/capture/test_dispatch.py checks all three)."""
    engine_threads = torch.get_num_threads()  # settles this thread's own count first
    ready = threading.Event()

    def run() -> None:
        torch.get_num_threads()
        torch.set_num_threads(threads)
        ready.set()
        target()

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    ready.wait()
    torch.set_num_threads(engine_threads)
    return thread
