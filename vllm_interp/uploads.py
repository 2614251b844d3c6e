"""Host-to-device copies on the step's critical path that never stall the GPU stream or the forward thread.

A copy from ordinary (pageable) host memory makes CUDA wait for the stream to drain first, so a per-step
upload done that way waits for the GPU to finish the step before it: the host can no longer plan step
``n + 1`` while the device runs step ``n`` (vLLM's async scheduling), and every step pays the planning time
on top. Steering indices and table rows, patch rows and capture rows are therefore staged in pinned memory
from PyTorch's caching host allocator, which records each async copy and reuses a block only once the copy
has read it. The staging copy is numpy's, on the calling thread: small torch CPU operations
(``pin_memory()`` is one) took about a millisecond each in the engine core of a loaded H100 server
(benchmarks/results/serve-gpu-2026-11-28.md), against tens of microseconds in a process alone. Used by steering,
patching and capture; on the CPU the data is simply wrapped.
"""

from collections.abc import Sequence

import numpy as np
import torch


def _torch_dtype(array: np.ndarray) -> torch.dtype:
    return torch.from_numpy(np.empty(0, array.dtype)).dtype


def _pinned(array: np.ndarray) -> torch.Tensor:
    host = torch.empty(array.shape, dtype=_torch_dtype(array), pin_memory=True)
    np.copyto(host.numpy(), array)
    return host


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """``array`` as a new tensor on ``device``, copied without synchronising the stream."""
    if device.type != "cuda":
        return torch.from_numpy(np.ascontiguousarray(array)).to(device)
    if not array.size:  # nothing to copy (and no pinned block to ask for)
        return torch.empty(array.shape, dtype=_torch_dtype(array), device=device)
    return _pinned(array).to(device, non_blocking=True)


def rows_to_device(blocks: Sequence[np.ndarray], device: torch.device) -> torch.Tensor:
    """The rows of ``blocks`` (each ``[rows, width]``), one after another, in float32 as a new ``[rows, width]``
    tensor on ``device``: concatenated straight into the pinned block, one host copy of the data. A burst of 128
    all-layer steering configs moves 16 MiB, as one block per config rather than one vector per site (numpy's
    per-array work: 512 vectors of 2048 floats stacked took 0.6 ms on an H200 host)."""
    if device.type != "cuda":
        return to_device(np.concatenate(blocks).astype(np.float32, copy=False), device)
    width = blocks[0].shape[1]
    rows = sum(block.shape[0] for block in blocks)
    host = torch.empty((rows, width), dtype=torch.float32, pin_memory=True)
    np.concatenate(blocks, out=host.numpy())
    return host.to(device, non_blocking=True)


def copy_into(target: torch.Tensor, array: np.ndarray) -> None:
    """Copy host data of ``target``'s shape into ``target`` (a device tensor, or a view of one)."""
    if target.is_cuda:
        target.copy_(_pinned(array), non_blocking=True)
    else:
        target.copy_(torch.from_numpy(np.ascontiguousarray(array)))
