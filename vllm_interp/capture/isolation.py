"""Where a consumer's code runs: on its runner thread in the worker, or in a process of its own.

A consumer's work (statistics, serialisation, writing files) on a thread of the worker holds the worker's
interpreter lock in turns with the forward loop, so a burst of large captures slows every request of the
engine. With ``isolation=process`` (``--capture-consumers NAME:isolation=process``; the default of the
built-in ``filesystem`` consumer) the consumer lives in a child process: the runner thread gathers each
request's rows straight into a shared-memory block (a file in ``/dev/shm``, its space reserved before it is
mapped so a full ``/dev/shm`` is an error, never a bus fault), sends the metadata and the block's path over a
socket, and goes on to the next request while the child works (up to ``PIPELINE_DEPTH`` requests in flight,
answered in order). The child maps the block, calls ``consume``, and answers from a thread of its own, so
that it goes on reading the worker's next request while a large answer is sent (a request's positions and a
``logging`` answer's statistics both outgrow the socket's buffer at 100,000 positions: sending each from the
reading thread, both processes waited on their sends for good). Its ``close`` runs at
shutdown, or when the socket to the worker closes, so a sharded file layout still publishes what it buffered
(not when the child is killed with the worker: ``vllm-interp serve`` gives the engine a grace period to close
its consumers when stopped, engine/v0_26/serve.py).

Blocks are reused, request after request, and stay mapped in both processes: a fresh block per request cost
about what the disk's write of it costs (H100 host, a 34 MB request: 4 ms to reserve it and 17-20 ms of page
faults to gather into it, against 6.5 ms into pages already mapped). A request takes the smallest spare block
that serves its size as it is, else a new block: a block is never resized, which would map it afresh in both
processes, and spares are given up only past ``SPARE_MAX_BYTES``, oldest first. Giving up every spare over four
times a small request's block, as the worker did, threw away the large blocks of a bulk sink's parts whenever
a small final part came, and the next parts reserved, mapped and faulted in new ones (H200 host, a sink burst:
sizing blocks took 218 of the runner thread's 1,749 samples, and unmapping given-up ones 119 of the child's).
A consumer may keep a request's tensors past ``consume`` (the ``sharded`` file layout buffers them until their
shard is written): the child sees that the block is still referenced when ``consume`` returns and answers so,
and the worker *lends* the block rather than reuse it. With every answer the child lists the lent blocks the
consumer has since let go of, and the worker takes those back as spares, so kept rows cost neither a copy nor
a fresh block. At most ``MAX_LENT_BLOCKS`` are lent: past that the oldest is given up (its pages live on in
the child until the consumer lets go). ``InThread`` tells a kept block the same way (``patch_source``, on the
worker's thread, holds its sources) and gives such a consumer fresh memory.

The child is started with ``subprocess`` (vLLM's worker processes are daemonic, and daemonic processes may
not start ``multiprocessing`` children), builds its consumer from the pickled class and context, and reports
a constructor's error back, so a bad option still fails the engine at start-up.
"""

import logging
import math
import mmap
import os
import queue
import socket
import subprocess
import sys
import tempfile
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from vllm_interp.capture.consumer import CaptureConsumer, CaptureMeta, ConsumerContext, PendingCapture, RequestCapture

Isolation = Literal["thread", "process"]
ISOLATIONS: tuple[str, ...] = ("thread", "process")
START_TIMEOUT_S = 300.0  # importing torch in the child on a loaded 2-core machine takes a while
SHARED_DIR = "/dev/shm"
# Requests handed to a child before the oldest one's answer is awaited: the runner thread gathers the next
# requests' rows while the child consumes (or writes) the last. With a fresh block per request, 32 MB requests
# to a sharded layout on the dev CPU's disk went at 490-520 MB/s one at a time and 580-600 with four in flight,
# to the packed layout (a sync per request) 480-510 -> 720-730 with two. With blocks reused the depth matters
# little for the sharded layout (dev CPU 881 / 824 MB/s at one / four; H100 host 494 / 516): it is for
# consumers that wait on the disk per request. Each request in flight holds a block (a request's room in the
# consumer's queue_mb is held until it is answered).
PIPELINE_DEPTH = 4
BLOCK_GRAIN = 2 << 20  # blocks are sized in these steps, so requests of similar sizes share one without resizing
# Blocks a consumer may keep at once before the oldest is given up: a sharded layout holds three shards' parts
# (one filling, two being written: 96 parts of 8 MiB at the default sizes), with room to spare.
MAX_LENT_BLOCKS = 256
# Spare blocks kept for later requests. Lent blocks come back a shard at a time (a sharded layout's 256 MiB of
# parts at the default sizes), and the parts after it reuse them; a block over this is given up once answered.
SPARE_MAX_BYTES = 512 << 20


class ConsumerProcessError(RuntimeError):
    """A consumer's failure in its process, as ``"ExceptionType: message"``; ``kept``: whether the consumer
    still holds the request's block."""

    def __init__(self, message: str, kept: bool = False) -> None:
        super().__init__(message)
        self.kept = kept


class InThread:
    """The consumer runs on its runner's thread; blocks are ordinary memory, one reused from request to request
    (sized in ``BLOCK_GRAIN`` steps, as shared blocks are): a fresh block costs a large request its page faults
    every time. Whether the consumer keeps a request's rows past ``consume`` (a tensor of them still holds the
    block's memory afterwards; no GC pass here, on the worker) is told from its first request, which gets
    memory of its exact size; a consumer that keeps rows gets exactly sized fresh memory from then on, so
    what it keeps (patch sources keep theirs) costs what it did before reuse."""

    def __init__(self, consumer: CaptureConsumer) -> None:
        self.consumer = consumer
        self.context = consumer.context
        self.consumer_class = type(consumer)
        self.blocks_made = 0  # memory made for requests' rows (the rest reused a spare)
        self._spare: np.ndarray | None = None
        self._reuse: bool | None = None  # unknown until its first request; False once it keeps rows

    def submit(self, pending: PendingCapture) -> Future:
        """Consume ``pending`` now; the future holds the consumer's result or its exception."""
        future: Future = Future()
        memory = self._memory_for(pending.nbytes)
        unheld = sys.getrefcount(memory)
        try:
            block = _view(memory, pending.shape, pending.dtype)
            pending.fill(block)
            future.set_result(self.consumer.consume(RequestCapture.of_block(pending.meta, block)))
        except Exception as exc:
            future.set_exception(exc)
            return future  # the failure's traceback may hold the rows: the memory is not reused
        del block
        kept = sys.getrefcount(memory) > unheld
        self._reuse = self._reuse is not False and not kept
        if not kept:
            self._spare = memory
        return future

    def _memory_for(self, nbytes: int) -> np.ndarray:
        spare, self._spare = self._spare, None
        if self._reuse and spare is not None and _serves(spare.size, nbytes):
            return spare
        self.blocks_made += 1
        # Exactly sized until reuse is known to be safe (and for a consumer that keeps rows).
        return np.empty(_block_size(nbytes) if self._reuse else nbytes, dtype=np.uint8)

    def settle(self) -> None:
        """Nothing is ever outstanding here."""

    def close(self) -> None:
        self.consumer.close()


class InProcess:
    """The consumer runs in a child process; blocks live in shared memory. Up to ``PIPELINE_DEPTH`` requests
    are with the child at once; it answers them in order."""

    def __init__(self, cls: type[CaptureConsumer], context: ConsumerContext) -> None:
        self.context = context
        self.consumer_class = cls
        self._in_flight: deque[tuple[Future, str, _SharedBlock | None]] = deque()  # (future, doing, its block)
        self._spare: list[_SharedBlock] = []  # blocks the child answered for and let go of, oldest first
        self.blocks_made = 0  # shared blocks made for requests' rows (the rest reused a spare)
        self._lent: dict[str, _SharedBlock] = {}  # blocks whose rows the consumer keeps, oldest first
        self._given_up: list[str] = []  # blocks removed since the last message: the child drops its mappings
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
        doing = f"consuming request {pending.meta.request_id}"
        block = None
        try:
            if pending.nbytes:
                block = self._block_for(pending.nbytes)
                filled = block.tensor(pending.shape, pending.dtype)
                pending.fill(filled)
                del filled  # the worker's view: the block may be resized or released only without one
            given_up, self._given_up = self._given_up, []
            self._send(("consume", pending.meta, block and block.path, block and block.size, pending.shape,
                        pending.dtype, given_up), doing)
        except BaseException:
            if block is not None:
                self._give_up(block)  # what the child saw of it, if anything, is unknown: never reused
            raise
        future: Future = Future()
        self._in_flight.append((future, doing, block))
        return future

    def _block_for(self, nbytes: int) -> "_SharedBlock":
        """The smallest spare block that serves ``nbytes`` as it is (``_serves``), else a new one."""
        serving = [block for block in self._spare if _serves(block.size, nbytes)]
        if serving:
            block = min(serving, key=lambda b: b.size)
            self._spare.remove(block)
            return block
        block = _SharedBlock(self._dir, _block_size(nbytes))
        self.blocks_made += 1
        return block

    def _give_up(self, block: "_SharedBlock") -> None:
        block.release()
        self._given_up.append(block.path)

    def settle(self) -> None:
        """Wait for the child's answer to every request sent."""
        while self._in_flight:
            self._receive_oldest()

    def _receive_oldest(self) -> None:
        future, doing, block = self._in_flight.popleft()
        kept: bool | None = None  # unknown unless the child answers: the block is then given up
        try:
            try:
                answer, kept = self._receive(doing)
            except ConsumerProcessError as exc:
                kept = exc.kept
                raise
            finally:
                # Before the outcome: whoever sees it finds the block reused, lent or gone.
                if block is not None:
                    self._settle_block(block, kept)
        except Exception as exc:  # whatever keeps the answer from coming is this request's failure
            future.set_exception(exc)
        else:
            future.set_result(answer)

    def _settle_block(self, block: "_SharedBlock", kept: bool | None) -> None:
        if kept is None:
            self._give_up(block)
        elif kept:
            self._lent[block.path] = block
            while len(self._lent) > MAX_LENT_BLOCKS:
                self._give_up(self._lent.pop(next(iter(self._lent))))
        else:
            self._keep_spare(block)

    def _take_back(self, paths: list[str]) -> None:
        """Lent blocks the consumer has let go of become spares (one given up since is not lent any more)."""
        for path in paths:
            block = self._lent.pop(path, None)
            if block is not None:
                self._keep_spare(block)

    def _keep_spare(self, block: "_SharedBlock") -> None:
        """Keep ``block`` for a later request; past ``SPARE_MAX_BYTES`` of spares the oldest are given up (a block
        over it alone at once)."""
        if block.size > SPARE_MAX_BYTES:
            self._give_up(block)
            return
        self._spare.append(block)
        spare_bytes = sum(spare.size for spare in self._spare)
        while spare_bytes > SPARE_MAX_BYTES:
            oldest = self._spare.pop(0)
            spare_bytes -= oldest.size
            self._give_up(oldest)

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
        return self._receive(doing)[0]

    def _send(self, message: tuple, doing: str) -> None:
        try:
            self._conn.send(message)
        except OSError:
            raise self._exited(doing) from None

    def _receive(self, doing: str) -> tuple[Any, bool]:
        """The child's answer, and whether it still holds the request's block (see the module docstring); the
        lent blocks it lists as let go of are taken back."""
        try:
            status, value, kept, returned = self._conn.recv()
        except (EOFError, OSError):
            raise self._exited(doing) from None
        self._take_back(returned)
        if status == "error":
            raise ConsumerProcessError(value, kept)
        return value, kept

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
        for block in [*self._spare, *self._lent.values(),
                      *(block for _, _, block in self._in_flight if block is not None)]:
            block.release()
        self._spare.clear()
        self._lent.clear()
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


class _SharedBlock:
    """A file of shared memory the worker keeps mapped and gathers request after request into."""

    def __init__(self, directory: Path, size: int) -> None:
        self.fd, self.path = tempfile.mkstemp(dir=directory)
        self.size = size
        try:
            # Reserve the pages first: a write through a mapping /dev/shm cannot back is a SIGBUS.
            os.posix_fallocate(self.fd, 0, size)
        except OSError as exc:
            self.release()
            raise RuntimeError(f"no room for a {size >> 20} MiB block of rows in {directory}: {exc}") from None
        self._mapped: mmap.mmap | None = mmap.mmap(self.fd, size)

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        assert self._mapped is not None
        return _view(self._mapped, shape, dtype)

    def release(self) -> None:
        """Unmap and remove the block (a child still holding rows of it keeps its own mapping)."""
        self._mapped = None
        os.close(self.fd)
        os.unlink(self.path)


def _block_size(nbytes: int) -> int:
    return -(-nbytes // BLOCK_GRAIN) * BLOCK_GRAIN


def _serves(size: int, nbytes: int) -> bool:
    """Whether a block of ``size`` bytes takes a request of ``nbytes`` as it is: large enough, and not over four
    times the block the request would get (a small request does not hold a large block's pages, which a large
    one may need while the consumer has it)."""
    return nbytes <= size <= 4 * _block_size(nbytes)


def _view(memory: mmap.mmap | np.ndarray, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A ``shape`` block of ``dtype`` at the start of ``memory``. The tensor, and every view of it, holds a
    reference to ``memory``: that is how a block a consumer kept is told."""
    nbytes = math.prod(shape) * dtype.itemsize
    return torch.from_numpy(np.frombuffer(memory, dtype=np.uint8, count=nbytes)).view(dtype).view(shape)


class _ChildBlocks:
    """The child's mappings of the worker's blocks, kept from request to request while the blocks are reused,
    and which of them are lent: the consumer still views them."""

    def __init__(self) -> None:
        self._mapped: dict[str, mmap.mmap] = {}
        self._lent: set[str] = set()

    def view(self, path: str, size: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        mapped = self._mapped.get(path)
        if mapped is None:  # a block new to the child (the worker never resizes one)
            with open(path, "r+b") as f:
                mapped = self._mapped[path] = mmap.mmap(f.fileno(), size)
        return _view(mapped, shape, dtype)

    def views(self, path: str) -> int:
        """How many arrays of the block exist (every tensor of the block holds one; this dict holds the mapping,
        and ``getrefcount`` its argument)."""
        return sys.getrefcount(self._mapped[path]) - 2

    def settle(self, path: str) -> bool:
        """Whether the consumer kept rows of the block it was just given; a kept block is lent from then on."""
        kept = self.views(path) > 0
        if kept:
            self._lent.add(path)
        return kept

    def returned(self) -> list[str]:
        """Lent blocks the consumer has let go of since the last call: the worker may reuse them."""
        free = [path for path in self._lent if self.views(path) == 0]
        self._lent.difference_update(free)
        return free

    def forget(self, paths: list[str]) -> None:
        """Blocks the worker gave up (lent past its limit, or a request failed with them): their pages go once
        nothing maps them."""
        for path in paths:
            self._mapped.pop(path, None)
            self._lent.discard(path)


def _serve(conn: Connection) -> None:
    """The child: build the consumer, then answer requests until told to close or the worker goes away. Every
    answer is ``(status, value, kept, returned)``: ``kept`` tells whether the consumer still holds the request's
    block, ``returned`` lists the lent blocks it has let go of."""
    cls, context, level = conn.recv()
    if cls.process_threads is not None:
        torch.set_num_threads(cls.process_threads)
    logging.basicConfig(format="%(levelname)s %(asctime)s [%(name)s] %(message)s")
    logging.getLogger("vllm_interp").setLevel(level)
    try:
        consumer = cls(context)
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}", False, []))
        return
    conn.send(("ok", None, False, []))
    blocks, answers = _ChildBlocks(), _Answers(conn)
    try:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                consumer.close()  # the worker is gone: publish what is buffered, nobody will ask again
                return
            if message[0] == "close":
                answers.send((*_outcome(consumer.close), False, blocks.returned()))
                return
            answers.send((*_consume(consumer, blocks, *message[1:]), blocks.returned()))
    finally:
        answers.close()


class _Answers:
    """The child's answers, sent in order from a thread of their own (see the module docstring)."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._queue: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._send_all, name="vllm-interp-answers", daemon=True)
        self._thread.start()

    def send(self, answer: tuple) -> None:
        self._queue.put(answer)

    def close(self) -> None:
        """Send what is queued, then stop."""
        self._queue.put(None)
        self._thread.join()

    def _send_all(self) -> None:
        while (answer := self._queue.get()) is not None:
            try:
                self._conn.send(answer)
            except OSError:  # the worker is gone: the reading thread sees it too, and stops
                return


def _outcome(call: Callable[..., Any], *args: Any) -> tuple[str, Any]:
    try:
        return "ok", call(*args)
    except Exception as exc:  # the request's failure, reported to the worker; the child keeps serving
        return "error", f"{type(exc).__name__}: {exc}"


def _consume(consumer: CaptureConsumer, blocks: _ChildBlocks, meta: CaptureMeta, path: str | None,
             size: int | None, shape: tuple[int, ...], dtype: torch.dtype,
             given_up: list[str]) -> tuple[str, Any, bool]:
    """Consume one request: ``(status, value, kept)``."""
    blocks.forget(given_up)
    if path is None:  # no rows
        return (*_outcome(lambda: consumer.consume(RequestCapture.of_block(meta, torch.empty(shape, dtype=dtype)))),
                False)
    try:
        rows = blocks.view(path, size, shape, dtype)
    except OSError as exc:  # this request's failure; the child keeps serving
        return "error", f"{type(exc).__name__}: {exc}", False
    capture = RequestCapture.of_block(meta, rows)
    del rows
    outcome = _outcome(consumer.consume, capture)
    del capture  # what is left of the block's views is the consumer's
    return (*outcome, blocks.settle(path))


if __name__ == "__main__":
    _serve(Connection(int(sys.argv[1])))
