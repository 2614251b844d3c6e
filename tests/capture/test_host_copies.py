"""The pinned-memory budget that lets landed blocks stay where they landed (GPU engines; CPU tensors stand in)."""

import gc

import torch

from vllm_interp.capture.host_copies import PinnedBudget


def test_a_held_block_counts_until_its_last_view_is_gone():
    budget = PinnedBudget(limit=1000)
    block = torch.zeros(2, 10, 25, dtype=torch.float32)  # 2,000 bytes: over the limit
    assert not budget.hold(block) and budget.held == 0
    block = torch.zeros(2, 10, 10, dtype=torch.float32)  # 800 bytes
    assert budget.hold(block) and budget.held == 800
    parts = [block[:, start : start + 5] for start in (0, 5)]  # each request's rows, as the store files them
    assert not budget.hold(torch.zeros(100, dtype=torch.float32))  # 400 more would pass the limit
    del block
    gc.collect()
    assert budget.held == 800  # the views still hold it
    del parts
    gc.collect()
    assert budget.held == 0
    assert budget.hold(torch.zeros(100, dtype=torch.float32))
