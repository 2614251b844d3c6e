"""Where a consumer's code runs: on its runner thread in the worker, or in a process of its own.

A consumer's work (statistics, serialisation, writing files) on a thread of the worker holds the worker's
interpreter lock in turns with the forward loop, so a burst of large captures slows every request of the
engine. With ``isolation=process`` (``--capture-consumers NAME:isolation=process``; the default of the
built-in ``logging`` and ``filesystem`` consumers) the consumer lives in a child process: the runner thread
gathers each request's rows straight into a shared-memory block (a file in ``/dev/shm``, its space reserved
before it is mapped so a full ``/dev/shm`` is an error, never a bus fault), sends the metadata and the
block's path over a socket, and goes on to the next request while the child works (up to
``PIPELINE_DEPTH`` requests in flight, answered in order). The child maps the block, calls ``consume``, and
answers; its ``close`` runs at shutdown, or when the socket to the worker closes, so a sharded file layout
still publishes what it buffered (not when the child is killed with the worker: ``vllm-interp serve`` gives
the engine a grace period to close its consumers when stopped, engine/v0_26/serve.py).

The child is started with ``subprocess`` (vLLM's worker processes are daemonic, and daemonic processes may
not start ``multiprocessing`` children), builds its consumer from the pickled class and context, and reports
a constructor's error back, so a bad option still fails the engine at start-up.
"""

import logging
import mmap
import os
import socket
import subprocess
import sys
import tempfile
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Literal

import torch

from vllm_interp.capture.consumer import CaptureConsumer, CaptureMeta, ConsumerContext, PendingCapture, RequestCapture

Isolation = Literal["thread", "process"]
ISOLATIONS: tuple[str, ...] = ("thread", "process")
START_TIMEOUT_S = 300.0  # importing torch in the child on a loaded 2-core machine takes a while
SHARED_DIR = "/dev/shm"
# Requests handed to a child before the oldest one's answer is awaited: the runner thread gathers the next
# requests' rows while the child consumes (or writes) the last. On the dev CPU, 32 MB requests through a
# process to a sharded layout on disk went at 490-520 MB/s one at a time, 580-600 with four in flight (the
# disk's plain synced write: about 540); to the packed layout (a sync per request) 480-510 -> 720-730 with two.
# The shared memory in flight stays within the consumer's queue_mb: a request keeps its room until answered.
PIPELINE_DEPTH = 4


class ConsumerProcessError(RuntimeError):
    """A consumer's failure in its process, as ``"ExceptionType: message"``."""


def request_capture(meta: CaptureMeta, block: torch.Tensor) -> RequestCapture:
    """The consumer's view of a ``[sites, positions, hidden]`` block: one tensor per site, in site order."""
    return RequestCapture(meta, dict(zip(meta.sites, block.unbind(0), strict=True)))


class InThread:
    """The consumer runs on its runner's thread; blocks are ordinary memory."""

    def __init__(self, consumer: CaptureConsumer) -> None:
        self.consumer = consumer
        self.context = consumer.context
        self.row_reduction = type(consumer).row_reduction

    def submit(self, pending: PendingCapture) -> Future:
        """Consume ``pending`` now; the future holds the consumer's result or its exception."""
        future: Future = Future()
        try:
            block = torch.empty(pending.shape, dtype=pending.dtype)
            pending.fill(block)
            future.set_result(self.consumer.consume(request_capture(pending.meta, block)))
        except Exception as exc:
            future.set_exception(exc)
        return future

    def settle(self) -> None:
        """Nothing is ever outstanding here."""

    def close(self) -> None:
        self.consumer.close()


class InProcess:
    """The consumer runs in a child process; blocks live in shared memory. Up to ``PIPELINE_DEPTH`` requests
    are with the child at once; it answers them in order."""

    def __init__(self, cls: type[CaptureConsumer], context: ConsumerContext) -> None:
        self.context = context
        self.row_reduction = cls.row_reduction
        self._in_flight: deque[tuple[Future, str, int | None, str | None]] = deque()  # (future, doing, fd, path)
        self._dir = Path(tempfile.mkdtemp(prefix=f"vllm-interp-{context.name}-",
                                          dir=SHARED_DIR if os.path.isdir(SHARED_DIR) else None))
        ours, theirs = socket.socketpair()
        self._process = subprocess.Popen([sys.executable, "-m", __name__, str(theirs.fileno())],
                                         pass_fds=(theirs.fileno(),))
        theirs.close()
        self._conn = Connection(ours.detach())
        self._conn.send((cls, context, logging.getLogger("vllm_interp").getEffectiveLevel()))
        if not self._conn.poll(START_TIMEOUT_S):
            self._stop()
            raise RuntimeError(f"capture consumer {context.name}: its process did not start in {START_TIMEOUT_S:g} s")
        try:
            self._exchange(None, "starting")
        except ConsumerProcessError as exc:
            self._stop()
            raise RuntimeError(f"capture consumer {context.name}: {exc}") from None

    def submit(self, pending: PendingCapture) -> Future:
        """Gather ``pending``'s rows into a shared block and send it to the child; the future resolves when the
        child answers (``settle``, or a later ``submit`` making room). Raises if the rows cannot be sent."""
        while len(self._in_flight) >= PIPELINE_DEPTH:
            self._receive_oldest()
        nbytes = pending.nbytes
        doing = f"consuming request {pending.meta.request_id}"
        fd = path = None
        try:
            if nbytes:
                fd, path = tempfile.mkstemp(dir=self._dir)
                self._fill(fd, pending)
            self._send(("consume", pending.meta, path, pending.shape, pending.dtype), doing)
        except BaseException:
            self._release(fd, path)
            raise
        future: Future = Future()
        self._in_flight.append((future, doing, fd, path))
        return future

    def settle(self) -> None:
        """Wait for the child's answer to every request sent."""
        while self._in_flight:
            self._receive_oldest()

    def _fill(self, fd: int, pending: PendingCapture) -> None:
        nbytes = pending.nbytes
        try:
            # Reserve the pages first: a write through a mapping /dev/shm cannot back is a SIGBUS.
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as exc:
            raise RuntimeError(f"no room for {nbytes >> 20} MiB of rows in {self._dir}: {exc}") from None
        with mmap.mmap(fd, nbytes) as mapped:
            block = torch.frombuffer(mapped, dtype=torch.uint8).view(pending.dtype).view(pending.shape)
            pending.fill(block)
            del block  # the mapping closes only once no tensor points into it

    def _receive_oldest(self) -> None:
        future, doing, fd, path = self._in_flight.popleft()
        try:
            try:
                answer = self._receive(doing)
            finally:
                self._release(fd, path)  # before the outcome: whoever sees it finds the block gone
        except Exception as exc:  # whatever keeps the answer from coming is this request's failure
            future.set_exception(exc)
        else:
            future.set_result(answer)

    @staticmethod
    def _release(fd: int | None, path: str | None) -> None:
        """The child maps a block while it needs it: the worker's name and descriptor can go once it answered."""
        if fd is not None:
            os.close(fd)
        if path is not None:
            os.unlink(path)

    def close(self) -> None:
        try:
            self.settle()
            self._exchange(("close",), "closing")
        finally:
            self._stop()

    def _exchange(self, message: tuple | None, doing: str) -> Any:
        """Send ``message`` (None: only wait for the answer) and return the child's answer."""
        if message is not None:
            self._send(message, doing)
        return self._receive(doing)

    def _send(self, message: tuple, doing: str) -> None:
        try:
            self._conn.send(message)
        except OSError:
            raise self._exited(doing) from None

    def _receive(self, doing: str) -> Any:
        try:
            status, value = self._conn.recv()
        except (EOFError, OSError):
            raise self._exited(doing) from None
        if status == "error":
            raise ConsumerProcessError(value)
        return value

    def _exited(self, doing: str) -> RuntimeError:
        return RuntimeError(f"capture consumer {self.context.name}: its process exited ({self._exit_code()}) "
                            f"while {doing}; its later requests fail too")

    def _exit_code(self) -> int | None:
        """The child's exit status (its socket closes a moment before it is reaped)."""
        try:
            return self._process.wait(5)
        except subprocess.TimeoutExpired:
            return None

    def _stop(self) -> None:
        self._conn.close()
        try:
            self._process.wait(60)
        except subprocess.TimeoutExpired:
            self._process.kill()
        for leftover in self._dir.iterdir():
            leftover.unlink()
        self._dir.rmdir()


def consumer_host(cls: type[CaptureConsumer], context: ConsumerContext, isolation: Isolation) -> InThread | InProcess:
    """Where ``cls`` runs (see the module docstring)."""
    return InProcess(cls, context) if isolation == "process" else InThread(cls(context))


def _serve(conn: Connection) -> None:
    """The child: build the consumer, then answer requests until told to close or the worker goes away."""
    cls, context, level = conn.recv()
    logging.basicConfig(format="%(levelname)s %(asctime)s [%(name)s] %(message)s")
    logging.getLogger("vllm_interp").setLevel(level)
    try:
        consumer = cls(context)
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ok", None))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            consumer.close()  # the worker is gone: publish what is buffered, nobody will ask again
            return
        if message[0] == "close":
            conn.send(_outcome(consumer.close))
            return
        conn.send(_outcome(partial(_consume, consumer, *message[1:])))


def _outcome(call: Callable[[], Any]) -> tuple[str, Any]:
    try:
        return "ok", call()
    except Exception as exc:  # the request's failure, reported to the worker; the child keeps serving
        return "error", f"{type(exc).__name__}: {exc}"


def _consume(consumer: CaptureConsumer, meta: CaptureMeta, path: str | None, shape: tuple[int, ...],
             dtype: torch.dtype) -> dict[str, Any] | None:
    if path is None:  # no rows
        block = torch.empty(shape, dtype=dtype)
    else:
        with open(path, "r+b") as f:
            mapped = mmap.mmap(f.fileno(), 0)  # stays mapped while the consumer holds a tensor of it
        block = torch.frombuffer(mapped, dtype=torch.uint8).view(dtype).view(shape)
    return consumer.consume(request_capture(meta, block))


if __name__ == "__main__":
    _serve(Connection(int(sys.argv[1])))
