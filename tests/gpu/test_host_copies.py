"""Blocks leave the device intact: large ones through the pinned arena, several in flight at once, landed in
order, each split per request (or, the arena full, pinned on their own and unpinned after); small ones whole,
each copy's event recorded on the stream it was queued on and reused once landed; none overwritten by a later
block's copy or by the device's later writes; blocks held for requests that take parts stay intact while
viewed."""

import pytest
import torch

from vllm_interp.capture import host_copies
from vllm_interp.capture.host_copies import PINNED_CACHED_MAX_BYTES, SplitCopy, WholeCopy

pytestmark = pytest.mark.gpu


def test_large_blocks_land_intact_through_the_arena():
    sites, hidden = 16, 2048
    rows = PINNED_CACHED_MAX_BYTES // (sites * hidden * 2) + 64  # just over the size that takes the arena
    splits = [(0, rows // 3), (rows // 3, rows)]
    device_block = torch.empty(sites, rows, hidden, dtype=torch.bfloat16, device="cuda")
    in_flight: list[tuple[int, SplitCopy]] = []
    for step in range(12):
        device_block.fill_(step)
        in_flight.append((step, SplitCopy(splits, device_block)))
        device_block.fill_(-1)  # after the copy was queued: it must not reach the host copy
        if len(in_flight) > 2:  # blocks land a step or two after they were copied
            landed, copy = in_flight.pop(0)
            copy.wait()
            for (start, stop), part in zip(splits, copy.parts, strict=True):
                assert part.shape == (sites, stop - start, hidden)
                assert bool((part == landed).all()), f"step {landed}'s rows were overwritten"
    assert host_copies.ARENA._memory is not None and host_copies.ARENA._memory.is_pinned()
    for _, copy in in_flight:  # as the store lands every copy: their regions go back
        copy.wait()
    assert not host_copies.ARENA._regions


def test_a_large_block_the_arena_has_no_room_for_is_pinned_on_its_own_and_unpinned_after(monkeypatch):
    """Outside torch's pinned cache: the cache's blocks (a burst's step blocks) stay cached for the next burst."""
    monkeypatch.setattr(host_copies.ARENA, "take", lambda nbytes: None)  # a full arena
    sites, hidden = 4, 2048
    rows = PINNED_CACHED_MAX_BYTES // (sites * hidden * 2) + 64
    device_block = torch.full((sites, rows, hidden), 7, dtype=torch.bfloat16, device="cuda")
    cached_before = torch.cuda.host_memory_stats().get("num_host_alloc", 0)
    copy = SplitCopy([(0, 1), (1, rows)], device_block)
    pinned = copy._pinned
    assert pinned.is_pinned()
    device_block.fill_(-1)
    copy.wait()
    assert bool((copy.parts[1] == 7).all()) and copy.parts[1].shape == (sites, rows - 1, hidden)
    assert not pinned.is_pinned()  # unpinned once copied out of
    assert torch.cuda.host_memory_stats().get("num_host_alloc", 0) == cached_before


def test_small_blocks_land_intact_from_the_stream_they_were_copied_on():
    block = torch.empty(4, 8, 64, device="cuda")
    in_flight: list[tuple[int, WholeCopy]] = []
    with torch.cuda.stream(torch.cuda.Stream()):  # not the default stream, whose events would not wait
        for step in range(40):
            torch.cuda._sleep(200_000)  # a busy stream: each copy lands well after it was queued
            block.fill_(step)
            in_flight.append((step, WholeCopy(block, [(0, 3), (3, 8)])))
            block.fill_(-1)
            if len(in_flight) > 2:
                landed, copy = in_flight.pop(0)
                copy.wait()
                assert bool((copy.part(1) == landed).all()), f"step {landed}'s rows were not the ones copied"
    assert host_copies._EVENTS, "landed copies' events are kept for reuse"


def test_held_blocks_stay_intact_while_viewed_and_give_their_memory_back_after():
    """Blocks whose readers all take parts stay in the pinned memory they landed in, from torch's cache or
    the arena: each request's view reads its rows after later blocks were copied, and an arena region goes
    back once no view of it is left."""
    sites, hidden = 16, 2048
    for rows in (64, PINNED_CACHED_MAX_BYTES // (sites * hidden * 2) + 64):  # torch's pinned cache, the arena
        splits = [(0, rows // 3), (rows // 3, rows)]
        device_block = torch.empty(sites, rows, hidden, dtype=torch.bfloat16, device="cuda")
        held = []
        for step in range(3):
            device_block.fill_(step)
            copy = WholeCopy(device_block, splits, keep_pinned=True)
            device_block.fill_(-1)
            copy.wait()
            held.append([copy.part(i) for i in range(len(splits))])  # the requests' views; the copy is let go
        for step, views in enumerate(held):
            for (start, stop), view in zip(splits, views, strict=True):
                assert view.shape == (sites, stop - start, hidden) and view.is_pinned()
                assert bool((view == step).all()), f"step {step}'s rows were overwritten while held"
        del held, views, view, copy
    host_copies.give_back_dropped()  # as the forward thread does when it next copies or lands blocks
    assert not host_copies.ARENA._regions, "every arena region goes back once its views are gone"


def test_a_steady_batchs_statistics_land_in_blocks_of_steps_equal_to_each_steps_own():
    """``ReducedSteps`` on the device: each step's statistics reduced into its slot of a block of steps (the
    kernel launched again directly while the rows view is the same, as a steady batch's replayed steps read it),
    landed with the block, equal to the statistics of that step's rows, though the view's rows change after
    every step as a later replay writes them; a different view goes through Triton again."""
    from vllm_interp.capture.consumers import statistics_kernel
    from vllm_interp.capture.consumers.logging import ROW_STATISTICS, STATS, torch_row_statistics

    buffers = torch.zeros(4, 3, 64, 2048, dtype=torch.bfloat16, device="cuda")  # [layers, hooks, rows, hidden]
    view = buffers[:, 2, :40]  # a replayed step's rows at post_block of every layer
    steps = host_copies.ReducedSteps(ROW_STATISTICS, (4, 40, len(STATS)), view.device)
    splits = [(row, row + 1) for row in range(40)]
    expected, landed = [], []
    for step in range(37):  # two full blocks and a partial one
        buffers.normal_()
        expected.append(torch_row_statistics(view).cpu())
        landed.append(steps.add(view, splits))
        assert step == 0 or statistics_kernel._repeatable[0] is view
    steps.send()
    for step, (copy, want) in enumerate(zip(landed, expected, strict=True)):
        copy.wait()
        torch.testing.assert_close(torch.from_numpy(copy.array), want, rtol=1e-5, atol=1e-5, msg=f"step {step}")
        assert copy.array_part(3).shape == (4, 1, len(STATS))
    other = buffers[:2, :, :8].flatten(0, 1)  # another view: launched through Triton, then repeatable in turn
    torch.testing.assert_close(ROW_STATISTICS.reduce(other), torch_row_statistics(other), rtol=1e-5, atol=1e-5)
    assert statistics_kernel._repeatable[0] is other
