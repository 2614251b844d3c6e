"""How a step's read rows land in host memory: small blocks whole, large ones split per request (or left where
they landed, given back once no view of them is left, when their readers all take parts); and the pinned
arena large blocks are copied into: a ring whose regions go back oldest first, which never hands out memory
still in use and says when it has no room (the block then takes fresh pinned memory), as it does for good when
the arena itself cannot be pinned."""

import threading

import numpy as np
import torch

from vllm_interp.capture import host_copies
from vllm_interp.capture.consumer import RowReduction
from vllm_interp.capture.host_copies import PinnedArena

MIB = 1 << 20


def arena() -> PinnedArena:
    """An arena of ordinary memory (a CPU machine has no pinned memory), sized at its first block."""
    return PinnedArena(allocate=lambda nbytes: torch.zeros(nbytes, dtype=torch.uint8))


def offset(memory: torch.Tensor, base: torch.Tensor) -> int:
    return memory.data_ptr() - base.data_ptr()


def test_blocks_take_the_ring_in_turn_and_wrap_once_the_oldest_go_back():
    ring = arena()
    first, give_back_first = ring.take(MIB)
    base = first  # the first block starts the arena, which holds SLOTS of it
    assert ring._memory.numel() == PinnedArena.SLOTS * MIB
    taken = [ring.take(MIB) for _ in range(PinnedArena.SLOTS - 1)]
    assert [offset(memory, base) for memory, _ in taken] == [MIB * (i + 1) for i in range(PinnedArena.SLOTS - 1)]
    assert ring.take(MIB) is None  # full: the caller pins fresh memory
    taken[0][1]()  # the second block goes back before the first: nothing is free until the first does
    assert ring.take(MIB) is None
    give_back_first()
    memory, _ = ring.take(2 * MIB)  # the two oldest regions, at the start of the ring again
    assert offset(memory, base) == 0
    assert ring.take(1) is None  # the rest is still in use


def test_a_block_is_never_given_memory_another_holds():
    ring = arena()
    held = {}
    generator = torch.Generator().manual_seed(0)
    ring.take(8 * MIB)[1]()  # sizes the arena: 32 MiB
    for step in range(200):
        nbytes = int(torch.randint(1, 10 * MIB, (1,), generator=generator))
        taken = ring.take(nbytes)
        if taken is not None:
            memory, give_back = taken
            memory.fill_(step % 251)
            held[step] = (memory, give_back, step % 251)
        # Blocks land in order: the oldest goes back first, a few steps later (enough held at once that the
        # ring runs full and wraps).
        while held and (len(held) > 4 or taken is None):
            oldest = min(held)
            memory, give_back, value = held.pop(oldest)
            assert bool((memory == value).all()), f"block of step {oldest} was overwritten"
            give_back()


def test_an_arena_that_cannot_be_pinned_leaves_every_block_to_fresh_pinned_memory(caplog):
    calls = []

    def no_room(nbytes: int) -> torch.Tensor:
        calls.append(nbytes)
        raise RuntimeError("CUDA error: out of memory")

    ring = PinnedArena(allocate=no_room)
    assert ring.take(MIB) is None and ring.take(MIB) is None
    assert calls == [PinnedArena.SLOTS * MIB]  # tried once, not at every block
    assert "no pinned arena of 4 MiB" in caplog.text


def test_a_cpu_engines_small_blocks_land_whole_and_large_ones_split_per_request(monkeypatch):
    """A small block is read through views (no copy on the forward thread; a request keeps at most
    WHOLE_MAX_BYTES of others' rows alive); a large one is split into each request's own memory."""
    splits = [(0, 1), (1, 3)]
    small = torch.randn(2, 3, 4)
    landed = host_copies.to_host(small, splits)
    assert isinstance(landed, host_copies.WholeCopy) and landed.done()
    assert landed.part(1).data_ptr() == small[:, 1:3].data_ptr()
    assert np.shares_memory(landed.array_part(0), small.numpy())

    hidden = host_copies.WHOLE_MAX_BYTES // (2 * 3 * 4) + 1
    large = torch.randn(2, 3, hidden)
    landed = host_copies.to_host(large, splits)
    assert isinstance(landed, host_copies.SplitCopy) and landed.done()
    for i, (start, stop) in enumerate(splits):
        assert torch.equal(landed.part(i), large[:, start:stop])
        assert not np.shares_memory(landed.array_part(i), large.numpy())
    # Readers that all take parts, or all end with the step, let go of the block soon: it is read where it
    # lies (on a GPU, the pinned memory it was copied into), not split.
    for held in (host_copies.to_host(large, splits, in_parts=True), host_copies.to_host(large, splits, whole=True)):
        assert isinstance(held, host_copies.WholeCopy) and held.keep_pinned and held.done()
        assert np.shares_memory(held.array_part(1), large.numpy())
    assert not host_copies.to_host(small, splits, whole=True).keep_pinned  # small blocks are copied out
    monkeypatch.setattr(host_copies, "PINNED_CACHED_MAX_BYTES", 0)  # every large block takes the arena ...
    copied = host_copies.to_host(large, splits, whole=True)  # ... whose ring would wait for a held one
    assert isinstance(copied, host_copies.WholeCopy) and not copied.keep_pinned


def test_held_pinned_memory_goes_back_once_the_last_view_of_it_is_gone():
    """A block left in the pinned memory it landed in gives that memory back only when no request's view of
    it is left (not when the copy, its array or its first views are dropped), and then on the forward thread:
    a consumer's thread that drops the last view only queues it."""
    released = []
    owner = host_copies._PinnedOwner(torch.arange(24, dtype=torch.bfloat16).reshape(2, 3, 4),
                                     lambda: released.append(threading.current_thread()))
    array = np.asarray(owner)
    first, second = array[:, 0:1], host_copies._tensor_of(array[:, 1:3], torch.bfloat16)
    del owner, array
    host_copies.give_back_dropped()
    assert not released
    del first
    host_copies.give_back_dropped()
    assert not released
    assert second[1, 1].tolist() == [20.0, 21.0, 22.0, 23.0]
    consumer = threading.Thread(target=lambda views: views.clear(), args=([second],))
    del second
    consumer.start()
    consumer.join()
    assert not released, "dropped on a consumer's thread: given back only by the forward thread"
    host_copies.give_back_dropped()
    assert released == [threading.current_thread()]


def test_a_batchs_steps_are_stacked_when_first_read_not_when_the_batch_ends():
    """A steady batch's steps are filed as one ``SteppedCopy`` when the batch ends, its last steps' summaries
    possibly still in flight (a block of steps not sent yet): it stacks them when a request's part is first read,
    once the forward thread has waited for them, and part ``k`` is request ``k``'s summaries of every step."""
    reduction = RowReduction("sum", 1, lambda rows: rows.sum(-1, keepdim=True))
    reduced = host_copies.ReducedSteps(reduction, (2, 3, 1), torch.device("cpu"))  # [sites, requests, width]
    rows = [torch.randn(2, 3, 4) for _ in range(3)]
    steps = [reduced.add(step_rows, [(0, 1), (1, 2), (2, 3)]) for step_rows in rows]
    assert not any(step.done() for step in steps)  # the block is not full: nothing sent
    stepped = host_copies.SteppedCopy(steps)  # the batch ends with its steps in flight
    reduced.send()
    for step in steps:  # the forward thread lands each step before finalizing a request that read in it
        step.wait()
    for k in range(3):
        expected = torch.stack([step_rows[:, k].sum(-1, keepdim=True) for step_rows in rows], dim=1)
        torch.testing.assert_close(stepped.part(k), expected)  # [sites, steps, width]
