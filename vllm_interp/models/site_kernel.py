"""The site op's body inside CUDA graphs: write, steer and read in one Triton kernel launch per site (and, with
steering alone, the eager op's steering add on CUDA: ``steer_in_place``).

A captured graph replays every kernel the op launched, on every step, whether or not a request uses a
feature: launched one torch op at a time, the patch write, steering add and read cost about a dozen kernels per
site (hundreds per decode step). One kernel does all three, per token row, driven by the persistent buffers
the runner fills before each step:

- **write**: a row whose ``patch_index`` slot is not 0 becomes ``lerp(stream, patch_values[slot],
  patch_alpha[slot])``, with ATen's formula (fused multiply-add in float32, alpha 1 a bit-exact copy);
- **steer**: a row whose ``steer_index`` is not 0 adds that row of the layer's steering table;
- **read**: when the site's ``read_flags`` entry is set, a row whose ``read_slot`` is ``s >= 0`` stores the
  resulting stream into row ``s`` of the site's ``read_out`` buffer, which the runner copies off after the step.

Rows the buffers do not name are neither loaded nor written: the results equal the eager op's (site_ops.py) bit for
bit for alpha 0 or 1 and steering, and to one rounding for other alphas.
"""

from typing import Any

import torch
import triton
import triton.language as tl


@triton.jit
def _site_kernel(hidden_ptr, residual_ptr, hidden_stride, residual_stride, width,
                 steer_index_ptr, steer_table_ptr, steer_stride,
                 patch_index_ptr, patch_values_ptr, patch_stride, patch_alpha_ptr,
                 read_slot_ptr, read_flag_ptr, read_out_ptr, read_stride,
                 HAS_RESIDUAL: tl.constexpr, HIDDEN_IN_USE: tl.constexpr, PATCH: tl.constexpr,
                 STEER: tl.constexpr, READ: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    # The row's slots first: a row no buffer names (every row of an idle engine, most rows of a busy one)
    # reads its slot entries and never loads the stream, which every site of every replayed step would pay.
    slot = 0
    steer_row = 0
    read_slot = -1
    if PATCH:
        slot = tl.load(patch_index_ptr + row)
    if STEER:
        steer_row = tl.load(steer_index_ptr + row)
    if READ:
        read_slot = tl.where(tl.load(read_flag_ptr) != 0, tl.load(read_slot_ptr + row), -1)
    if (slot > 0) | (steer_row != 0) | (read_slot >= 0):
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < width
        hidden_at = hidden_ptr + row * hidden_stride + cols
        hidden = tl.load(hidden_at, mask=mask)
        residual = hidden
        residual_at = residual_ptr + row * residual_stride + cols
        if HAS_RESIDUAL:
            residual = tl.load(residual_at, mask=mask)
        if slot > 0:
            stream = hidden.to(tl.float32)
            if HAS_RESIDUAL:
                stream = (stream + residual.to(tl.float32)).to(hidden.dtype).to(tl.float32)
            source = tl.load(patch_values_ptr + slot * patch_stride + cols, mask=mask).to(tl.float32)
            alpha = tl.load(patch_alpha_ptr + slot).to(tl.float32)
            diff = source - stream
            value = tl.where(tl.abs(alpha) < 0.5, tl.fma(alpha, diff, stream), tl.fma(-diff, 1.0 - alpha, source))
            value = value.to(hidden.dtype)
            if HAS_RESIDUAL:
                if HIDDEN_IN_USE:
                    residual = (value.to(tl.float32) - hidden.to(tl.float32)).to(hidden.dtype)
                else:
                    residual = value
                    hidden = tl.full((BLOCK,), 0, hidden.dtype)
                    tl.store(hidden_at, hidden, mask=mask)
                tl.store(residual_at, residual, mask=mask)
            else:
                hidden = value
                tl.store(hidden_at, hidden, mask=mask)
        if steer_row != 0:
            vector = tl.load(steer_table_ptr + steer_row * steer_stride + cols, mask=mask).to(tl.float32)
            if HAS_RESIDUAL:
                residual = (residual.to(tl.float32) + vector).to(hidden.dtype)
                tl.store(residual_at, residual, mask=mask)
            else:
                hidden = (hidden.to(tl.float32) + vector).to(hidden.dtype)
                tl.store(hidden_at, hidden, mask=mask)
        if read_slot >= 0:
            stream = hidden
            if HAS_RESIDUAL:
                stream = (hidden.to(tl.float32) + residual.to(tl.float32)).to(hidden.dtype)
            tl.store(read_out_ptr + read_slot * read_stride + cols, stream, mask=mask)


def site_in_graph(hidden: torch.Tensor, residual: torch.Tensor | None, steer_index: torch.Tensor,
                  steer_table: torch.Tensor | None, patch_index: torch.Tensor | None, patch_values: torch.Tensor,
                  patch_alpha: torch.Tensor, read_slot: torch.Tensor | None, read_flag: torch.Tensor,
                  read_out: torch.Tensor, hidden_in_use: bool) -> Any:
    """Launch the kernel over the flat ``[tokens, width]`` stream; None turns a part off (``steer_table``:
    this hook's ``[rows, width]`` table; ``read_flag``: a one-element view of the site's flag). Returns the
    compiled kernel Triton launched (None for no rows, or under Triton's interpreter)."""
    rows, width = hidden.shape
    if rows == 0:
        return None
    args = _site_args(hidden, residual, steer_index, steer_table, patch_index, patch_values, patch_alpha, read_slot,
                      read_flag, read_out, hidden_in_use)
    return _site_kernel[(rows, triton.cdiv(width, args[-1]))](*args)


def _site_args(hidden: torch.Tensor, residual: torch.Tensor | None, steer_index: torch.Tensor,
               steer_table: torch.Tensor | None, patch_index: torch.Tensor | None, patch_values: torch.Tensor,
               patch_alpha: torch.Tensor, read_slot: torch.Tensor | None, read_flag: torch.Tensor,
               read_out: torch.Tensor, hidden_in_use: bool) -> tuple:
    """``_site_kernel``'s arguments in its order, the constants last (``BLOCK`` the last of them): a part turned
    off passes a tensor it never reads in place of its own."""
    residual_arg = hidden if residual is None else residual
    return (
        hidden, residual_arg, hidden.stride(0), residual_arg.stride(0), hidden.shape[1],
        steer_index, hidden if steer_table is None else steer_table,
        0 if steer_table is None else steer_table.stride(0),
        steer_index if patch_index is None else patch_index, patch_values, patch_values.stride(0), patch_alpha,
        steer_index if read_slot is None else read_slot, read_flag, read_out, read_out.stride(0),
        residual is not None, hidden_in_use, patch_index is not None, steer_table is not None, read_slot is not None,
        min(1024, triton.next_power_of_2(hidden.shape[1])),
    )


# The compiled steering-alone kernel per launch key (``_steering_key``), launched again directly.
_STEERING_KERNELS: dict[tuple, Any] = {}


def _steering_key(stream: torch.Tensor, steer_index: torch.Tensor, table: torch.Tensor) -> tuple | None:
    """What Triton specializes a steering-alone launch on, besides the constants: the dtypes, the integer
    arguments (the width and the two row strides: each may be specialized as 1 or as a multiple of 16) and
    the pointers' alignment. None unless every pointer is 16-byte aligned, as a fresh tensor's is: such a
    launch goes through Triton, which specializes it on its own."""
    if any(tensor.data_ptr() % 16 for tensor in (stream, steer_index, table)):
        return None
    return stream.dtype, steer_index.dtype, table.dtype, stream.shape[1], stream.stride(0), table.stride(0)


def steer_in_place(stream: torch.Tensor, steer_index: torch.Tensor, table: torch.Tensor) -> None:
    """Add to each row of the flat ``[tokens, width]`` stream the row of ``table`` that ``steer_index`` names
    (row 0: none): the site op's eager steering on CUDA, one launch of the kernel with steering alone (a gather
    and an add were two launches, four torch calls and a copy of the gathered rows). Its one variant is built at
    start-up (``site_ops.warm_eager_steering``), not in the first steered step that runs eagerly.

    A step that runs eagerly (a prefill chunk) calls this at every steered site, each time with another layer's
    stream and table, so the last launch cannot be repeated as it was (as ``logging``'s statistics kernel is);
    but every such launch of an engine specializes alike: the kernel Triton compiled for a launch key is launched
    again directly (Triton's ``CompiledKernel[grid]``), without binding and specializing its sixteen arguments
    anew: 25.1 against 32.1 us of an H100 host's time a launch on a 64-token stream (``benchmarks/host_costs.py
    --device cuda --only eager_site``; benchmarks/results/serve-gpu-2026-12-07.md, session 47)."""
    rows, width = stream.shape
    if rows == 0:
        return
    key = _steering_key(stream, steer_index, table)
    compiled = _STEERING_KERNELS.get(key) if key is not None else None
    if compiled is None:
        compiled = site_in_graph(*steering_alone_args(stream, steer_index, table))
        if key is not None and compiled is not None:  # Triton's interpreter gives no kernel
            _STEERING_KERNELS[key] = compiled
        return
    args = _site_args(*steering_alone_args(stream, steer_index, table))
    compiled[(rows, triton.cdiv(width, args[-1]), 1)](*args)  # a compiled kernel's launcher takes three dimensions


def steering_alone_args(stream: torch.Tensor, steer_index: torch.Tensor, table: torch.Tensor) -> tuple:
    """``site_in_graph``'s arguments for steering alone (the eager op's add; ``benchmarks/host_costs.py`` times it
    through Triton's launch): the stream stands in for the buffers it never reads."""
    return stream, None, steer_index, table, None, stream, stream, None, steer_index, stream, False
