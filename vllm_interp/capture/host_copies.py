"""Moving a step's read rows off the device without holding up the forward thread.

Every capturing step leaves one gathered ``[sites, rows, hidden]`` block on the device (and, for consumers
with a row reduction, a small ``[sites, rows, width]`` block of summaries). The forward thread queues an
asynchronous copy of it into pinned host memory on its own stream and records an event, then goes on; the
block's device memory goes back to the stream's pool at once (later kernels of the stream run after the copy).
The store polls the events at later steps, on the forward thread, and lands each copy that has completed
(waiting for one only when a caller that may wait asks for a request's rows):

- ``WholeCopy`` lands in ordinary memory as a whole, in one copy (on a CPU engine, none: the block is its own
  memory already); a request's rows are views of it, taken where they are gathered. For blocks up to
  ``WHOLE_MAX_BYTES`` (every-token statistics to ``logging`` on an H100: decode steps 1.04x plain;
  benchmarks/results/bulk-capture-gpu-2026-11-27.md; on the dev CPU, splitting such blocks cost the forward
  thread 0.23 ms of a 64-request decode step), and for blocks of any size whose readers all read their last
  rows in the step (``last_prompt`` captures): those are handed to their consumers as soon as the step lands,
  so the block is let go within a few steps. Such a block over ``WHOLE_MAX_BYTES`` is not copied out but read
  where it landed (below), unless it takes the arena (over ``PINNED_CACHED_MAX_BYTES``), whose ring would wait
  for it: then it is copied out whole. numpy's copy of a 3 MiB ``last_prompt`` block out of pinned memory took
  1.24 ms of the forward thread on an H200 host (0.06 ms on the dev CPU), in every prefill step of a capturing
  wave.
- ``SplitCopy`` (the larger blocks) lands split into each request's own rows, so that a long request never
  keeps the others' rows alive. Splitting costs a copy per request into fresh memory on the forward thread: a
  ``last_prompt`` prefill step of 32 requests at 48 sites took 2.3-3.3 ms of it on an H200 host.
- A block whose readers all take their rows in parts (a bulk sink) is let go of within about a part, so it is not
  copied at all: it lands as a ``WholeCopy`` that keeps the pinned memory it was copied into, and the readers'
  gathers read it there; the memory goes back (to torch's pinned cache, or to the arena) once the last of them is
  done with it, on the forward thread when it next copies or lands blocks (``_PinnedOwner``). Splitting those blocks
  was 19% of the forward thread's samples in a sink burst on an H200 host (every token of 64 requests at 16 sites,
  2.1 GB). Torch's cache then holds the pinned memory of such a burst (the step blocks its queued and
  unfinished parts held at once) for the next one: it is never emptied. A block in the arena is held so only
  for readers that cut their parts at the next step, the others' rows copied out of it when it lands (the store
  decides, ``takes_arena``; ``WholeCopy.copies_of``): the ring waits for its oldest region.

A steady batch's row summaries (every-token capture to ``logging``: a few floats per row) are not copied step by
step: ``ReducedSteps`` reduces its consecutive steps into one device block and copies that off as a
``WholeCopy`` every ``ReducedSteps.STEPS`` steps, or sooner when the batch changes or a caller waits.

Blocks over ``PINNED_CACHED_MAX_BYTES`` are copied into ``PinnedArena``, pinned memory kept for them and used
as a ring, rather than into fresh pinned memory each time; one the ring has no room for is pinned on its own
and unpinned once copied out of (``pinned_on_its_own``), never through torch's cache.

No thread takes part. A copier thread used to land large blocks: first copying them itself from a stream of
its own into pageable memory, which made every CUDA call of the forward thread about ten times slower on an
H100 (``cudaMemcpyAsync`` 158 us on average against 15, kernel launches 118 us against 12), then only
splitting them; either way decode steps reading whole rows of 64 requests at 16 sites ran at 1.5-2.1x plain,
and splitting on the forward thread instead was faster in each of three rounds (1.43x against 1.54x;
``benchmarks/capture_breakdown.py``): a thread beside the forward loop costs more in turns at the
interpreter lock than the copy it takes off it.
"""

import logging
import math
import threading
import weakref
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import torch

from vllm_interp.capture.consumer import RowReduction

logger = logging.getLogger(__name__)

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
            self._pinned, self._event, self._release = start_pinned_copy(block)

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
        torch's cache, or to the arena, at once)."""
        if self.parts is None:
            self._event.synchronize()
            self.parts = split_copies(self._pinned, self.splits)
            self._pinned = self._event = None
            self._release()

    def part(self, i: int) -> torch.Tensor:
        """Request ``i``'s rows (after ``wait``)."""
        assert self.parts is not None
        return self.parts[i]

    def array_part(self, i: int) -> np.ndarray:
        """``part(i)`` as an array sharing its memory (``as_array``)."""
        return as_array(self.part(i))


class WholeCopy:
    """A block landed in ordinary memory as a whole (or, ``keep_pinned``, left in the pinned memory it was copied
    into); ``part`` is a view of it, taken where the request's rows are gathered."""

    def __init__(self, block: torch.Tensor, splits: list[tuple[int, int]], keep_pinned: bool = False) -> None:
        self.splits = splits
        self.keep_pinned = keep_pinned
        self._pinned: torch.Tensor | None = None
        self._event: torch.cuda.Event | None = None
        self._array: np.ndarray | None = None  # the landed block, sliced at numpy's cost
        self._dtype = block.dtype
        if block.is_cuda:
            self._pinned, self._event, self._release = start_pinned_copy(block)
        else:  # a CPU engine's rows are in host memory already, in a block of their own
            self._array = as_array(block)

    @property
    def array(self) -> np.ndarray:
        """The landed block (after ``wait``), in a dtype numpy has (``as_array``)."""
        assert self._array is not None
        return self._array

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    def done(self) -> bool:
        return self._array is not None or self._event.query()

    def wait(self) -> None:
        if self._array is not None:
            return
        self._event.synchronize()
        if self.keep_pinned:  # given back once the last view of it is gone
            self._array = np.asarray(_PinnedOwner(self._pinned, self._release))
        else:
            # Copied by numpy, not cloned by torch: every torch call gives up the interpreter lock and waits to
            # take it back, which on a loaded engine core's forward thread took tens of microseconds for a
            # clone of a few KiB (py-spy on an H200 host, every-token statistics).
            self._array = as_array(self._pinned).copy()
            self._release()
        self._pinned = self._event = None

    def part(self, i: int) -> torch.Tensor:
        return _tensor_of(self.array_part(i), self._dtype)

    def copies_of(self, indices: list[int]) -> dict[int, torch.Tensor]:
        """Own copies of the parts ``indices`` (after ``wait``), which keep nothing of this block alive."""
        if not indices:
            return {}
        host = _tensor_of(self.array, self._dtype)
        return dict(zip(indices, split_copies(host, [self.splits[i] for i in indices]), strict=True))

    def array_part(self, i: int) -> np.ndarray:
        """``part(i)`` as an array: a request's rows are gathered from one such view per step it read in that
        was filed for it alone, and slicing a tensor costs several microseconds to an array's fraction of one."""
        start, stop = self.splits[i]
        return self.array[:, start:stop]


class ReducedSteps:
    """The row summaries of a steady batch's consecutive steps (the same rows of the same requests), reduced
    straight into one device block of up to ``STEPS`` steps and copied off as one (``send``): when the block is
    full, when the batch ends (``_SteadyReads.settle``), or when a caller waits for one of its steps. Each step
    is a ``ReducedStep`` (a ``WholeCopy`` that lands with its block).

    Copied off step by step, every capturing decode step paid the forward thread a summary block, a pinned block,
    a copy, an event recorded, polled and waited for, and a numpy copy: about eight torch calls, each of which
    gives up the interpreter lock to the engine's other threads and waits to take it back (a plain decode step
    of the bulk workload is 3.1 ms of host time on an H100 host, every-token capture to ``logging`` added about
    0.5; benchmarks/results/bulk-capture-gpu-2026-12-06.md). Now a step pays the reduction's launch; the rest
    comes once per block."""

    STEPS = 16

    def __init__(self, reduction: RowReduction, shape: tuple[int, ...], device: torch.device) -> None:
        self.reduction = reduction
        self.shape = shape  # one step's summaries: [sites, rows, width]
        self._device = device
        # Each step's summaries start 16 bytes apart at least, as a fresh tensor's do: a kernel that specializes
        # on its pointers' alignment (Triton does) then runs the variant built at start-up.
        self._stride = _round_up(math.prod(shape), 4)
        self._block: _StepsBlock | None = None

    def add(self, rows: torch.Tensor, splits: list[tuple[int, int]]) -> "ReducedStep":
        """Reduce one step's ``[sites, rows, hidden]`` rows into the block (launched, not waited for)."""
        block = self._block
        if block is None or block.copy is not None:  # none yet, or sent early for a caller that waits
            block = self._block = _StepsBlock(torch.empty((self.STEPS, self._stride), dtype=torch.float32,
                                                          device=self._device), self.shape)
        index = block.count
        self.reduction.reduce_to(rows, block.slot(index))
        block.count += 1
        step = ReducedStep(block, index, splits)
        if block.count == self.STEPS:
            self.send()
        return step

    def send(self) -> None:
        """Start copying the steps reduced so far off the device; the next step starts a new block."""
        if self._block is not None:
            self._block.send()
            self._block = None


class _StepsBlock:
    """Up to ``ReducedSteps.STEPS`` steps' summaries on the device, then one ``WholeCopy`` of them."""

    def __init__(self, memory: torch.Tensor, shape: tuple[int, ...]) -> None:
        self.memory = memory  # [STEPS, padded size]
        self.shape = shape
        self.count = 0
        self.copy: WholeCopy | None = None
        self._size = math.prod(shape)
        # Every step's view made at once: three torch calls a block rather than two a step.
        self._slots = memory[:, : self._size].unflatten(1, shape).unbind(0)

    def slot(self, index: int) -> torch.Tensor:
        return self._slots[index]

    def send(self) -> None:
        if self.copy is None:
            self.copy = WholeCopy(self.memory[: self.count], [])
            self.memory, self._slots = None, ()

    def landed_step(self, index: int) -> np.ndarray:
        """Step ``index``'s summaries in host memory (the block sent and waited for where it was not)."""
        self.send()
        self.copy.wait()
        return self.copy.array[index, : self._size].reshape(self.shape)


class ReducedStep(WholeCopy):
    """One step's summaries within a ``ReducedSteps`` block: landed when the block has."""

    def __init__(self, block: _StepsBlock, index: int, splits: list[tuple[int, int]]) -> None:
        self.splits, self.keep_pinned = splits, False
        self._block, self._index = block, index
        self._array, self._dtype = None, torch.float32

    def done(self) -> bool:
        if self._array is not None:
            return True
        copy = self._block.copy
        return copy is not None and copy.done()

    def wait(self) -> None:
        if self._array is None:
            self._array = self._block.landed_step(self._index)
            self._block = None


class SteppedCopy:
    """``WholeCopy``s of consecutive steps of one batch, each ``[sites, requests, width]`` (a row per request),
    stacked as they are (``[steps, sites, requests, width]``): part ``k`` is request ``k``'s rows of every step,
    in step order, a strided view that the request's gather copies on its consumer's thread.

    Made when the batch ends, with its last steps' copies possibly still in flight; stacked when a part is first
    asked for, on that consumer's thread, by which time every step has landed (the forward thread waits for a
    step's copy before it finalizes any request that read in it). So the forward thread neither stacks the steps
    nor files the ones still in flight request by request (an every-token request then had a chunk for each of
    those, up to a block of ``ReducedSteps.STEPS`` and the next). Laying the rows out per request at once (a
    strided copy of every row) ran on the forward thread when the batch ended and its requests' results were
    awaited, and so did stacking the steps: for 64 every-token requests of 256 steps ending together
    (``benchmarks/host_costs.py``, dev CPU, A B A B) finalizing them took it 6.3-10.4 ms before the steps were
    stacked here and 3.8-3.9 ms since (``benchmarks/results/host-costs-cpu-2026-12-07.md``)."""

    def __init__(self, copies: list[WholeCopy]) -> None:
        self._copies: list[WholeCopy] | None = copies
        self._dtype = copies[0].dtype
        self._stacked: np.ndarray | None = None
        self._lock = threading.Lock()  # requests of the batch may be gathered on several consumers' threads

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        pass

    def part(self, i: int) -> torch.Tensor:
        return _tensor_of(self.array_part(i), self._dtype)

    def array_part(self, i: int) -> np.ndarray:
        return self._array()[:, :, i].swapaxes(0, 1)

    def _array(self) -> np.ndarray:
        with self._lock:
            if self._stacked is None:
                self._stacked = np.stack([copy.array for copy in self._copies])
                self._copies = None  # the stack holds the rows now
            return self._stacked


class _PinnedOwner:
    """Pinned memory lent to numpy views: ``np.asarray(owner)`` refers to the owner, and every view taken from
    that array (or from a tensor made of it) refers to the array in turn. Once the last view is gone, on
    whichever thread drops it, the memory and ``release`` are queued for the forward thread, which gives them
    back when it next copies or lands blocks (``give_back_dropped``): freeing pinned memory that a copy used
    records a CUDA event in torch's pinned cache (and a large block's ``release`` unpins it), and
    CUDA calls from a consumer's thread slow every CUDA call of the forward thread (see the module
    docstring)."""

    def __init__(self, pinned: torch.Tensor, release: Callable[[], None]) -> None:
        self.__array_interface__ = as_array(pinned).__array_interface__
        # The finalizer's arguments keep the memory allocated while the owner lives. Not at interpreter exit:
        # the memory goes with the process, and torch may be half torn down by then.
        weakref.finalize(self, _DROPPED.append, (pinned, release)).atexit = False


# Held pinned memory whose last view is gone, with what gives it back: appended on any thread (a deque's
# append is atomic), given back on the forward thread.
_DROPPED: deque[tuple[torch.Tensor, Callable[[], None]]] = deque()


def give_back_dropped() -> None:
    """Give back the held pinned memory whose views are all gone (on the forward thread: see ``_PinnedOwner``)."""
    while _DROPPED:
        pinned, release = _DROPPED.popleft()
        del pinned  # back to torch's pinned cache, or, from the arena, nothing until ``release``
        release()


def start_pinned_copy(block: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event, Callable[[], None]]:
    """Queue a copy of ``block`` into pinned host memory on the current stream, without waiting; returns the
    host tensor, an event that completes when it has landed, and what to call once the host tensor has been
    copied out of (its memory and the event are then reused). A large block goes to the arena when it has room,
    else to memory pinned for it alone (``pinned_on_its_own``); the others to torch's pinned cache."""
    give_back_dropped()  # first, so that a block reuses what was given back
    large = takes_arena(block)
    taken = ARENA.take(_nbytes(block)) if large else None
    if taken is not None:
        memory, release = taken
        pinned = memory.view(block.dtype).view(block.shape)
    elif large:
        pinned, release = pinned_on_its_own(block.shape, block.dtype)
    else:
        pinned, release = torch.empty(block.shape, dtype=block.dtype, pin_memory=True), _nothing
    pinned.copy_(block, non_blocking=True)
    event = _EVENTS.pop() if _EVENTS else torch.cuda.Event()
    event.record(_current_stream(block.get_device()))
    return pinned, event, partial(_landed, event, release)


def _nothing() -> None:
    """A block of torch's pinned cache goes back to it when its last view is gone: nothing else to do."""


def pinned_on_its_own(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, Callable[[], None]]:
    """Ordinary memory pinned for one large block (one the arena has no room for, a long prompt's eager
    prefill), outside torch's pinned cache, and what unpins it. Torch keeps what it pins cached for good,
    rounded up to a power of two, and the only way to give a block of it back is to empty the whole cache.
    Emptying it whenever none of our cached blocks was live, after such a block, threw away the step blocks
    of the burst, which the next steps then pinned afresh (H200 host, a sink phase of every-token capture
    after a warm-up one, py-spy: emptying 150 and pinning 454 of the forward thread's 2,257 samples; a 4 MiB
    block took 2 us from the cache and 1.9 ms pinned afresh, ``benchmarks/pinned_memory.py``; so torch's cache
    is never emptied now). Pinning and unpinning 512 MiB this way took 0.22-0.29 s there. The memory stays
    allocated until it is unpinned (``release`` holds it), so no other allocation can reuse it while pinned."""
    host = torch.empty(shape, dtype=dtype)
    cudart = torch.cuda.cudart()
    status = cudart.cudaHostRegister(host.data_ptr(), _nbytes(host), 0)
    if status != cudart.cudaError.success:
        raise RuntimeError(f"could not pin {_nbytes(host) >> 20} MiB for a capture block: "
                           f"{cudart.cudaGetErrorString(status)}")
    return host, partial(_unpin, cudart, host)


def _unpin(cudart: Any, host: torch.Tensor) -> None:
    cudart.cudaHostUnregister(host.data_ptr())


# Events whose copies have landed, recorded again for later ones: a fresh event per step costs creating and
# destroying it.
_EVENTS: list[torch.cuda.Event] = []
# ``torch.cuda.current_stream`` builds a ``Stream`` object under a device guard on every call: 59 us of an H200
# host's capturing decode step under torch's Python tracer (which inflates Python calls). The current stream's
# identity is a cheap call; the object is made once per stream (torch's streams live as long as the process).
_STREAMS: dict[tuple[int, int, int], torch.cuda.Stream] = {}


def _current_stream(device_index: int) -> torch.cuda.Stream:
    """The current stream of the device, as ``torch.cuda.current_stream`` gives it."""
    key = torch._C._cuda_getCurrentStream(device_index)  # a private name, present in the pinned torch 2.11
    stream = _STREAMS.get(key)
    if stream is None:
        stream = _STREAMS[key] = torch.cuda.Stream(stream_id=key[0], device_index=key[1], device_type=key[2])
    return stream


def _landed(event: torch.cuda.Event, release: Callable[[], None]) -> None:
    """After a copy was waited for and copied out of: its event goes back for reuse, its memory too."""
    _EVENTS.append(event)
    release()


class PinnedArena:
    """Pinned host memory that large blocks are copied into in turn, as a ring: blocks land in the order they
    were copied, and each is given back once copied out of (split, or whole) or, held where it landed, once the
    last view of it is gone, so the oldest is usually the next to go (the ring waits for it).

    A large block in fresh pinned memory costs pinning it (and unpinning it after, ``pinned_on_its_own``): in a
    burst of every-token captures, whose prefill steps make blocks of hundreds of MiB, that was 112 of the
    forward thread's 1,169 samples on an H200 host, and keeping those blocks in torch's cache instead was worse
    (289: the blocks' sizes vary, and its power-of-two rounding pinned ever new ones). The arena is allocated
    at the first large block, ``SLOTS`` times its size (at most ``MAX_BYTES``), and kept; a block it has no
    room for takes fresh pinned memory as before. Every copy into it is queued on the forward thread's
    stream, so a region given back is written again only after the copy that used it before."""

    SLOTS = 4  # large blocks in flight at once: a step's copy lands one or two steps later
    MAX_BYTES = 2 << 30
    ALIGN = 4096

    def __init__(self, allocate: Callable[[int], torch.Tensor] | None = None) -> None:
        self._allocate = allocate or (lambda nbytes: torch.empty(nbytes, dtype=torch.uint8, pin_memory=True))
        # Taken on the forward thread only (held regions dropped elsewhere are queued, ``give_back_dropped``); a
        # lock all the same, so that a region given back from another thread could never corrupt the ring.
        self._lock = threading.Lock()
        self._memory: torch.Tensor | None = None
        self._unavailable = False  # its allocation failed once: not tried again
        self._regions: deque[list] = deque()  # [start, stop, given back], oldest first

    def take(self, nbytes: int) -> tuple[torch.Tensor, Callable[[], None]] | None:
        """``nbytes`` of the arena and what gives them back, or None when it has no room for them."""
        with self._lock:
            return self._take(nbytes)

    def _take(self, nbytes: int) -> tuple[torch.Tensor, Callable[[], None]] | None:
        if self._memory is None:
            if self._unavailable:
                return None
            arena_bytes = min(self.MAX_BYTES, _round_up(self.SLOTS * nbytes, self.ALIGN))
            try:
                self._memory = self._allocate(arena_bytes)
            except RuntimeError as exc:  # no room to pin that much: every block is pinned fresh, as before
                logger.warning("vllm-interp: no pinned arena of %d MiB for large capture blocks (%s); each is "
                               "pinned on its own", arena_bytes >> 20, exc)
                self._unavailable = True
                return None
        size, need = self._memory.numel(), _round_up(nbytes, self.ALIGN)
        if not self._regions:
            start = 0 if need <= size else None
        else:
            head, tail = self._regions[-1][1], self._regions[0][0]
            if head > tail:  # live regions run from tail to head: room after head, else from 0 up to tail
                start = head if head + need <= size else 0 if need <= tail else None
            else:  # wrapped: room between head and tail
                start = head if head + need <= tail else None
        if start is None:
            return None
        region = [start, start + need, False]
        self._regions.append(region)
        return self._memory[start: start + nbytes], partial(self._give_back, region)

    def _give_back(self, region: list) -> None:
        with self._lock:
            region[2] = True
            while self._regions and self._regions[0][2]:
                self._regions.popleft()


ARENA = PinnedArena()


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def split_copies(host: torch.Tensor, splits: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Copies of ``host[:, start:stop]`` for each split, made in one call: allocated by numpy and copied by
    one multi-tensor copy. A clone per request (64 a step) is 64 torch calls, and each gives up the
    interpreter lock, which a thread beside a busy forward loop then waits to take back (dev CPU,
    ``benchmarks/host_costs.py``: 0.26 ms alone, 7.4 beside a busy thread; this 0.25 and 4.4, one wait)."""
    sites, _, hidden = host.shape
    same_width = as_array(host).dtype  # numpy lacks some of torch's dtypes (bfloat16)
    copies = [_tensor_of(np.empty((sites, stop - start, hidden), dtype=same_width), host.dtype)
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


def _tensor_of(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """``as_array``'s inverse: the array's memory as a tensor of ``dtype``."""
    tensor = torch.from_numpy(array)
    return tensor.view(dtype) if tensor.dtype != dtype else tensor


def takes_arena(block: torch.Tensor) -> bool:
    """Whether a copy of ``block`` goes to the pinned arena (when it has room), whose ring waits for its oldest
    region: such a block is held only briefly."""
    return _nbytes(block) > PINNED_CACHED_MAX_BYTES


def to_host(block: torch.Tensor, splits: list[tuple[int, int]], whole: bool = False,
            in_parts: bool = False) -> SplitCopy | WholeCopy:
    """``block`` on its way to host memory, split by ``splits``: landed whole when small; left where it lands
    when its readers let go of it soon (``in_parts``: they all take parts; ``whole``: they all end with the step,
    unless it takes the arena, whose ring would wait for it: then copied out whole); else split per request, at
    once on the CPU, and on the GPU once its copy has landed."""
    if _nbytes(block) <= WHOLE_MAX_BYTES:
        return WholeCopy(block, splits)
    if in_parts or (whole and not takes_arena(block)):
        return WholeCopy(block, splits, keep_pinned=True)
    if whole:
        return WholeCopy(block, splits)
    return SplitCopy(splits, block) if block.is_cuda else SplitCopy.landed(block, splits)
