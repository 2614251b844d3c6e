"""Moving a step's read rows off the device without costing the step anything.

Every capturing step leaves one gathered ``[sites, rows, hidden]`` block on the device. A copy into pinned
memory allocated per step would pin new pages every step (the blocks stay alive until their requests finish,
so the pinned-memory cache never reuses them; pinning costs far more than copying), and a copy into ordinary
memory on the forward thread waits for the step to finish. So a thread of its own copies each block, in order,
on a stream of its own (after an event the forward thread recorded behind the gather), into ordinary memory,
and then releases the device block. Device memory in flight is bounded (``max_bytes``): past it the forward
thread waits for the copier, which only happens when the host cannot keep up with the rows asked for.
"""

import threading
from collections import deque

import torch

MAX_BYTES_IN_FLIGHT = 1 << 30


class HostCopy:
    """One block on its way to host memory; ``host`` is set once ``done``."""

    def __init__(self, block: torch.Tensor | None = None, host: torch.Tensor | None = None) -> None:
        self.block = block
        self.nbytes = 0 if block is None else block.numel() * block.element_size()
        self.event: torch.cuda.Event | None = None
        self.host = host
        self._done = threading.Event()
        if host is not None:
            self._done.set()

    @classmethod
    def landed(cls, host: torch.Tensor) -> "HostCopy":
        """Rows already in host memory (a CPU engine)."""
        return cls(host=host)

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> torch.Tensor:
        self._done.wait()
        assert self.host is not None
        return self.host


class HostCopier:
    def __init__(self, device: torch.device, max_bytes: int = MAX_BYTES_IN_FLIGHT) -> None:
        self.device = device
        self.max_bytes = max_bytes
        self._queue: deque[HostCopy] = deque()
        self._in_flight = 0
        self._cond = threading.Condition()
        threading.Thread(target=self._run, name="vllm-interp-host-copies", daemon=True).start()

    def submit(self, block: torch.Tensor) -> HostCopy:
        """Queue ``block`` (just gathered on the current stream) for copying; returns at once unless the
        device memory in flight is past its bound."""
        copy = HostCopy(block)
        copy.event = torch.cuda.Event()
        copy.event.record()
        with self._cond:
            self._cond.wait_for(lambda: not self._in_flight or self._in_flight + copy.nbytes <= self.max_bytes)
            self._in_flight += copy.nbytes
            self._queue.append(copy)
            self._cond.notify_all()
        return copy

    def _run(self) -> None:
        torch.cuda.set_device(self.device)
        stream = torch.cuda.Stream(self.device)
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._queue))
                copy = self._queue.popleft()
            with torch.cuda.stream(stream):
                stream.wait_event(copy.event)
                host = copy.block.to("cpu")  # ordinary memory: returns once the copy is complete
            # The copy is complete, so the block can go back to the forward stream's pool as it is.
            copy.block = copy.event = None
            copy.host = host
            with self._cond:
                self._in_flight -= copy.nbytes
                self._cond.notify_all()
            copy._done.set()
