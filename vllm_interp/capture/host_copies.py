"""Moving a step's read rows off the device without holding up the forward thread.

Every capturing step leaves one gathered ``[sites, rows, hidden]`` block on the device (and, for consumers
with a row reduction, a small ``[sites, rows, width]`` block of summaries). The forward thread queues an
asynchronous copy of it into pinned host memory on its own stream and records an event, then goes on; the
block's device memory goes back to the stream's pool at once (later kernels of the stream run after the copy).
What happens once the copy lands depends on the size:

- ``PinnedCopy`` (blocks up to ``PINNED_MAX_BYTES``): the store polls the event at later steps and lands the
  block in ordinary memory; a request's rows are views of it, taken where they are gathered. No thread and no
  interpreter lock shared with one (every-token statistics to ``logging`` on an H100: decode steps 1.04x plain;
  benchmarks/results/bulk-capture-gpu-2026-11-27.md).
- ``HostCopy`` (larger blocks): a copier thread waits for the event and splits the block into each request's
  own rows (so a long request never keeps the others' rows alive), then lets the pinned memory go. Pinned
  memory in flight is bounded (``max_bytes``): past it the forward thread waits for the copier, which only
  happens when the host cannot keep up.

The copier makes no CUDA call but an event wait. It used to copy each block itself, from its own stream into
pageable memory: on an H100 every CUDA call of the forward thread then took about ten times as long
(``cudaMemcpyAsync`` 158 us on average against 15, kernel launches 118 us against 12) and decode steps that
read whole rows at 16 sites x 64 requests ran at 2.1x plain (``benchmarks/capture_breakdown.py``).
"""

import threading
from collections import deque
from collections.abc import Callable

import numpy as np
import torch

# Pinned memory stays in torch's host cache once allocated: bound what the copier may lag behind by.
MAX_BYTES_IN_FLIGHT = 256 << 20
# Small enough that a step's block, held by its requests as views until they finish, wastes little memory.
PINNED_MAX_BYTES = 1 << 20


class HostCopy:
    """One ``[sites, rows, hidden]`` block on its way to host memory, split by requests: ``part(i)`` holds the
    rows ``splits[i]`` (a request's own copy: a view would keep every other request's rows of the step alive
    for as long as that request runs)."""

    def __init__(self, splits: list[tuple[int, int]], nbytes: int = 0) -> None:
        self.splits = splits
        self.nbytes = nbytes
        self.pinned: torch.Tensor | None = None  # the copy in flight
        self.event: torch.cuda.Event | None = None
        self.parts: list[torch.Tensor] | None = None
        self._done = threading.Event()

    @classmethod
    def landed(cls, host: torch.Tensor, splits: list[tuple[int, int]]) -> "HostCopy":
        """Rows already in host memory (a CPU engine): split here."""
        copy = cls(splits)
        copy.land(host)
        return copy

    def land(self, host: torch.Tensor) -> None:
        """Take each request's rows out of ``host``: ordinary memory of their own (pinned memory goes back to
        torch's cache at once, never held for as long as a request runs)."""
        self.parts = split_copies(host, self.splits) if self.pinned is not None or len(self.splits) > 1 else [host]
        self.pinned = self.event = None
        self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> None:
        self._done.wait()

    def part(self, i: int) -> torch.Tensor:
        """Request ``i``'s rows (after ``wait``)."""
        assert self.parts is not None
        return self.parts[i]

    def array_part(self, i: int) -> np.ndarray:
        """``part(i)`` as an array sharing its memory (``as_array``)."""
        return as_array(self.part(i))


def start_pinned_copy(block: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
    """Queue a copy of ``block`` into pinned host memory on the current stream, without waiting; returns the
    host tensor and an event that completes when it has landed."""
    pinned = torch.empty(block.shape, dtype=block.dtype, pin_memory=True)
    pinned.copy_(block, non_blocking=True)
    event = torch.cuda.Event(blocking=True)  # waited for on the copier: sleep, do not spin on a core
    event.record()
    return pinned, event


class PinnedCopy:
    """A small block copied by the forward thread into pinned memory without waiting; ``wait`` lands it in
    ordinary memory (pinned pages go back to PyTorch's host cache at once); ``part`` is a view of it, taken
    where the request's rows are gathered, off the forward thread."""

    def __init__(self, block: torch.Tensor, splits: list[tuple[int, int]]) -> None:
        self.splits = splits
        pinned, self._event = start_pinned_copy(block)
        self._pinned: torch.Tensor | None = pinned
        self._host: torch.Tensor | None = None
        self._array: np.ndarray | None = None  # the same memory, for slicing at numpy's cost

    def done(self) -> bool:
        return self._host is not None or self._event.query()

    def wait(self) -> None:
        if self._host is None:
            self._event.synchronize()
            self._host, self._pinned = self._pinned.clone(), None
            self._array = as_array(self._host)

    def part(self, i: int) -> torch.Tensor:
        assert self._host is not None
        start, stop = self.splits[i]
        return self._host[:, start:stop]

    def array_part(self, i: int) -> np.ndarray:
        """``part(i)`` as an array: a request's rows are gathered from one such view per step it read in, and
        slicing a tensor costs several microseconds to an array's fraction of one."""
        assert self._array is not None
        start, stop = self.splits[i]
        return self._array[:, start:stop]


def split_copies(host: torch.Tensor, splits: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Copies of ``host[:, start:stop]`` for each split, made in one call. A thread other than the forward loop
    gives up the interpreter lock in every torch op and, behind a busy forward loop, waits up to the switch
    interval to take it back: a clone per request (64 a step) took 0.3 ms alone and 7.8 ms beside a busy
    thread on the dev CPU; allocated by numpy (which keeps the lock) and copied in one call, 0.3 and 0.8."""
    sites, _, hidden = host.shape
    copies = [torch.from_numpy(np.empty(sites * (stop - start) * hidden * host.element_size(), dtype=np.uint8))
              .view(host.dtype).view(sites, stop - start, hidden) for start, stop in splits]
    # torch's multi-tensor copy (a private name, present in the pinned torch 2.11).
    torch._foreach_copy_(copies, [host[:, start:stop] for start, stop in splits])
    return copies


def as_array(tensor: torch.Tensor) -> np.ndarray:
    """A CPU tensor as a numpy array sharing its memory; a dtype numpy lacks (bfloat16) as same-width integers,
    which is all that copying rows needs."""
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    return tensor.numpy()


def to_host(block: torch.Tensor, splits: list[tuple[int, int]],
            copier: Callable[[torch.device], "HostCopier"]) -> "HostCopy | PinnedCopy":
    """``block`` on its way to host memory, split by ``splits``: landed at once on the CPU, copied by the
    forward thread when small, by ``copier(block.device)`` (started on first use) when large."""
    if not block.is_cuda:
        return HostCopy.landed(block, splits)
    if block.numel() * block.element_size() <= PINNED_MAX_BYTES:
        return PinnedCopy(block, splits)
    return copier(block.device).submit(block, splits)


class HostCopier:
    def __init__(self, device: torch.device, max_bytes: int = MAX_BYTES_IN_FLIGHT) -> None:
        self.device = device
        self.max_bytes = max_bytes
        self._queue: deque[HostCopy] = deque()
        self._in_flight = 0
        self._cond = threading.Condition()
        threading.Thread(target=self._run, name="vllm-interp-host-copies", daemon=True).start()

    def submit(self, block: torch.Tensor, splits: list[tuple[int, int]]) -> HostCopy:
        """Start copying ``block`` (just gathered on the current stream) into pinned memory and queue it for
        splitting; returns at once unless the pinned memory in flight is past its bound."""
        copy = HostCopy(splits, block.numel() * block.element_size())
        with self._cond:
            self._cond.wait_for(lambda: not self._in_flight or self._in_flight + copy.nbytes <= self.max_bytes)
            self._in_flight += copy.nbytes
        copy.pinned, copy.event = start_pinned_copy(block)
        with self._cond:
            self._queue.append(copy)
            self._cond.notify_all()
        return copy

    def _run(self) -> None:
        torch.cuda.set_device(self.device)
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._queue))
                copy = self._queue.popleft()
            nbytes = copy.nbytes
            copy.land(self._to_host(copy))
            with self._cond:
                self._in_flight -= nbytes
                self._cond.notify_all()

    @staticmethod
    def _to_host(copy: HostCopy) -> torch.Tensor:
        """The block in host memory, once its copy has landed."""
        assert copy.event is not None and copy.pinned is not None
        copy.event.synchronize()
        return copy.pinned
