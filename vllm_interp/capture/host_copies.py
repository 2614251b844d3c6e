"""Moving a step's read rows off the device without holding up the forward thread.

Every capturing step leaves one gathered ``[sites, rows, hidden]`` block on the device (and, for consumers
with a row reduction, a small ``[sites, rows, width]`` block of summaries). The forward thread queues an
asynchronous copy of it into pinned host memory on its own stream and records an event, then goes on; the
block's device memory goes back to the stream's pool at once (later kernels of the stream run after the copy).
The store polls the events at later steps, on the forward thread, and lands each copy that has completed
(waiting for one only when a caller that may wait asks for a request's rows):

- ``WholeCopy`` lands in ordinary memory as a whole, in one copy; a request's rows are views of it, taken where
  they are gathered. For blocks up to ``WHOLE_MAX_BYTES`` on the GPU (every-token statistics to ``logging`` on an H100:
  decode steps 1.04x plain; benchmarks/results/bulk-capture-gpu-2026-11-27.md), and for blocks of any size
  whose readers all read their last rows in the step (``last_prompt`` captures): those are handed to their
  consumers as soon as the step lands, so the block is let go within a few steps.
- ``SplitCopy`` (the other blocks: larger ones on the GPU, all of them on a CPU engine) lands split into each
  request's own rows, so that a long request never keeps the others' rows alive. Splitting costs a copy per
  request into fresh memory on the forward thread: a ``last_prompt`` prefill step of 32 requests at 48 sites
  took 2.3-3.3 ms of it on an H200 host.

No thread takes part. A copier thread used to land large blocks: first copying them itself from a stream of
its own into pageable memory, which made every CUDA call of the forward thread about ten times slower on an
H100 (``cudaMemcpyAsync`` 158 us on average against 15, kernel launches 118 us against 12), then only
splitting them; either way decode steps reading whole rows of 64 requests at 16 sites ran at 1.5-2.1x plain,
and splitting on the forward thread instead was faster in each of three rounds (1.43x against 1.54x;
``benchmarks/capture_breakdown.py``): a thread beside the forward loop costs more in turns at the
interpreter lock than the copy it takes off it.
"""

import numpy as np
import torch

# Small enough that a step's block, held by its requests as views until they finish, wastes little memory.
WHOLE_MAX_BYTES = 1 << 20
# Larger blocks (every-token whole rows of a decode step are a few MiB) stay in torch's pinned cache.
PINNED_CACHED_MAX_BYTES = 64 << 20


class SplitCopy:
    """One ``[sites, rows, hidden]`` block on its way to host memory, split by requests: ``part(i)`` holds the
    rows ``splits[i]`` (a request's own copy: a view would keep every other request's rows of the step alive
    for as long as that request runs)."""

    def __init__(self, splits: list[tuple[int, int]], block: torch.Tensor | None = None) -> None:
        self.splits = splits
        self.parts: list[torch.Tensor] | None = None
        self._pinned: torch.Tensor | None = None
        self._event: torch.cuda.Event | None = None
        if block is not None:
            self._pinned, self._event = start_pinned_copy(block)

    @classmethod
    def landed(cls, host: torch.Tensor, splits: list[tuple[int, int]]) -> "SplitCopy":
        """Rows already in host memory (a CPU engine): split here, or kept whole for a single request."""
        copy = cls(splits)
        copy.parts = [host] if len(splits) == 1 else split_copies(host, splits)
        return copy

    def done(self) -> bool:
        return self.parts is not None or self._event.query()

    def wait(self) -> None:
        """Land the copy: each request's rows in ordinary memory of their own (the pinned memory goes back to
        torch's cache at once)."""
        if self.parts is None:
            self._event.synchronize()
            self.parts = split_copies(self._pinned, self.splits)
            nbytes = _nbytes(self._pinned)
            self._pinned = self._event = None
            _let_go(nbytes)

    def part(self, i: int) -> torch.Tensor:
        """Request ``i``'s rows (after ``wait``)."""
        assert self.parts is not None
        return self.parts[i]

    def array_part(self, i: int) -> np.ndarray:
        """``part(i)`` as an array sharing its memory (``as_array``)."""
        return as_array(self.part(i))


class WholeCopy:
    """A block landed in ordinary memory as a whole; ``part`` is a view of it, taken where the request's rows
    are gathered."""

    def __init__(self, block: torch.Tensor, splits: list[tuple[int, int]]) -> None:
        self.splits = splits
        self._pinned: torch.Tensor | None = None
        self._event: torch.cuda.Event | None = None
        self._host: torch.Tensor | None = None
        self._array: np.ndarray | None = None  # the same memory, for slicing at numpy's cost
        if block.is_cuda:
            self._pinned, self._event = start_pinned_copy(block)
        else:  # a CPU engine's rows are in host memory already, in a block of their own
            self._land(block)

    def done(self) -> bool:
        return self._host is not None or self._event.query()

    def wait(self) -> None:
        if self._host is None:
            self._event.synchronize()
            self._land(self._pinned.clone())
            nbytes = _nbytes(self._pinned)
            self._pinned = self._event = None
            _let_go(nbytes)

    def _land(self, host: torch.Tensor) -> None:
        self._host, self._array = host, as_array(host)

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


def start_pinned_copy(block: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
    """Queue a copy of ``block`` into pinned host memory on the current stream, without waiting; returns the
    host tensor and an event that completes when it has landed."""
    pinned = torch.empty(block.shape, dtype=block.dtype, pin_memory=True)
    pinned.copy_(block, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return pinned, event


def _let_go(nbytes: int) -> None:
    """After a landed block's pinned memory (``nbytes``) was copied out and dropped: torch keeps pinned blocks
    cached for good, rounded up to a power of two, so what a rare large block (a long prompt's eager prefill)
    took is given back instead of held locked."""
    if nbytes > PINNED_CACHED_MAX_BYTES:
        torch._C._host_emptyCache()  # a private name, present in the pinned torch 2.11


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def split_copies(host: torch.Tensor, splits: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Copies of ``host[:, start:stop]`` for each split, made in one call: allocated by numpy and copied by
    one multi-tensor copy. A clone per request (64 a step) is 64 torch calls, and each gives up the
    interpreter lock, which a thread beside a busy forward loop then waits to take back (dev CPU,
    ``benchmarks/host_costs.py``: 0.26 ms alone, 7.4 beside a busy thread; this 0.25 and 4.4, one wait)."""
    sites, _, hidden = host.shape
    same_width = as_array(host).dtype  # numpy lacks some of torch's dtypes (bfloat16)
    copies = [torch.from_numpy(np.empty((sites, stop - start, hidden), dtype=same_width)).view(host.dtype)
              for start, stop in splits]
    # torch's multi-tensor copy (a private name, present in the pinned torch 2.11).
    torch._foreach_copy_(copies, [host[:, start:stop] for start, stop in splits])
    return copies


def as_array(tensor: torch.Tensor) -> np.ndarray:
    """A CPU tensor as a numpy array sharing its memory; a dtype numpy lacks (bfloat16) as same-width integers,
    which is all that copying rows needs."""
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    return tensor.numpy()


def to_host(block: torch.Tensor, splits: list[tuple[int, int]], whole: bool = False) -> SplitCopy | WholeCopy:
    """``block`` on its way to host memory, split by ``splits``: landed whole when ``whole`` (its readers let go
    of it soon); else landed split at once on the CPU, and on the GPU copied without waiting, to land whole when
    small and split per request when large."""
    if whole:
        return WholeCopy(block, splits)
    if not block.is_cuda:
        return SplitCopy.landed(block, splits)
    return WholeCopy(block, splits) if _nbytes(block) <= WHOLE_MAX_BYTES else SplitCopy(splits, block)
