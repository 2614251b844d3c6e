"""Host-to-device copies on the step's critical path that never stall the GPU stream.

A copy from ordinary (pageable) host memory makes CUDA wait for the stream to drain first, so a per-step
upload done that way waits for the GPU to finish the step before it: the host can no longer plan step
``n + 1`` while the device runs step ``n`` (vLLM's async scheduling), and every step pays the planning time
on top. Steering indices, patch rows and capture rows are therefore staged in pinned memory from PyTorch's
caching host allocator, which records each async copy and reuses a block only once the copy has read it.
Used by steering, patching and capture; on the CPU the data is simply wrapped.
"""

import numpy as np
import torch


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """``array`` as a new tensor on ``device``, copied without synchronising the stream."""
    host = torch.from_numpy(np.ascontiguousarray(array))
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def copy_into(target: torch.Tensor, array: np.ndarray | torch.Tensor) -> None:
    """Copy host data of ``target``'s shape into ``target`` (a device tensor, or a view of one)."""
    host = torch.from_numpy(np.ascontiguousarray(array)) if isinstance(array, np.ndarray) else array
    if target.is_cuda:
        target.copy_(host.pin_memory(), non_blocking=True)
    else:
        target.copy_(host)
