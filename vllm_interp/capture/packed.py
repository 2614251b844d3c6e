"""Tensors in a consumer's result as bytes, shape and dtype: the form that crosses the worker's process
boundaries (a consumer's own process, the engine core, the API server) as one buffer.

vLLM's msgpack carries bytes as they are but would not rebuild a tensor nested in a result, and a result of
Python floats costs a conversion, a pickle and a decode per element at every hop (41,000 floats of every-token
statistics: several ms a request). A consumer packs what it returns; its ``result_from_wire`` unpacks on the
caller's side, once.
"""

from typing import Any

import torch


def pack(tensor: torch.Tensor) -> dict[str, Any]:
    """``{"dtype", "shape", "data"}``: the tensor's bytes (row-major) with what rebuilds it."""
    # Only the calls it needs: on a consumer's runner thread each torch call hands the interpreter lock back
    # and forth with the forward loop (a captured block is usually a contiguous CPU tensor already).
    if tensor.requires_grad or tensor.device.type != "cpu" or not tensor.is_contiguous():
        tensor = tensor.detach().cpu().contiguous()
    shape = list(tensor.shape)
    flat = tensor if shape else tensor.reshape(1)  # a 0-d tensor has no last dimension to view as bytes
    return {"dtype": str(tensor.dtype).removeprefix("torch."), "shape": shape,
            "data": flat.view(torch.uint8).numpy().tobytes()}


def unpack(packed: dict[str, Any]) -> torch.Tensor:
    """The tensor ``pack`` described (it owns its memory)."""
    dtype, shape, data = getattr(torch, packed["dtype"]), packed["shape"], packed["data"]
    if not data:  # frombuffer refuses an empty buffer
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)
