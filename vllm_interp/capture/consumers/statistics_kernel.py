"""``logging``'s row statistics on a GPU in one Triton kernel launch per step.

``row_statistics`` in torch is nine operations (a float copy, mean, two norms, a subtraction, a division, min,
max, a stack), each a launch the forward thread pays after every capturing step: about 0.26 ms a decode step of
an H200 host's thread (py-spy, 64 every-token requests at 16 sites; benchmarks/results/
bulk-capture-gpu-2026-11-28.md), where a serving step takes 3-4 ms. This kernel computes the same five numbers
per row, in the same way (float32; the standard deviation as the norm of the centred row over the square root
of the width), with one program per row holding the whole row.
"""

from collections.abc import Callable

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["outer_stride", "inner_count"])
def _row_statistics_kernel(rows_ptr, out_ptr, width, outer_stride, row_stride, inner_count,
                           STATS: tl.constexpr, BLOCK: tl.constexpr):
    # Row ``i`` of the flattened output is row ``i % inner_count`` of block ``i // inner_count`` of the input.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < width
    at = rows_ptr + (row // inner_count) * outer_stride + (row % inner_count) * row_stride
    x = tl.load(at + cols, mask=inside, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=0) / width
    centred = tl.where(inside, x - mean, 0.0)
    out = out_ptr + row * STATS
    tl.store(out, tl.sqrt(tl.sum(x * x, axis=0)))
    tl.store(out + 1, mean)
    tl.store(out + 2, tl.sqrt(tl.sum(centred * centred, axis=0)) / tl.sqrt(width.to(tl.float32)))
    tl.store(out + 3, tl.min(tl.where(inside, x, float("inf")), axis=0))
    tl.store(out + 4, tl.max(tl.where(inside, x, float("-inf")), axis=0))


# The last launch that may be repeated as it was, but for its output: its rows view, its statistics count and a
# launcher taking the output.
_repeatable: tuple[torch.Tensor, int, Callable[[torch.Tensor], None]] | None = None


def row_statistics_kernel(rows: torch.Tensor, stats: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """``[..., stats]`` float32 statistics of each row of ``rows`` (``[..., width]``, any float dtype), in
    the order norm, mean, std, min, max; written into ``out`` (contiguous, of that shape) where given. A
    ``[blocks, rows, width]`` view with rows of unit stride is read where it lies: a replayed step's rows are
    such a view of the graph read buffers (rows of consecutive layers, the buffers' row count apart), and
    copying them out first was an ``aten::clone`` of 58 us on an H200 host's forward thread each decode step
    (torch profiler).

    A steady batch's replayed steps read the same view step after step: the kernel Triton chose for it is then
    launched again directly (Triton's ``CompiledKernel[grid]``), without binding and specializing the
    arguments anew, which is most of a launch's host time. Only the output differs, and it is aligned as the
    first one was (16 bytes: Triton's one specialization of a pointer), or the launch goes through Triton."""
    global _repeatable
    if out is None:
        out = torch.empty((*rows.shape[:-1], stats), dtype=torch.float32, device=rows.device)
    aligned = out.data_ptr() % 16 == 0
    last = _repeatable
    if last is not None and last[0] is rows and last[1] == stats and aligned:
        last[2](out)
        return out
    given, width = rows, rows.shape[-1]
    if rows.dim() != 3 or rows.stride(-1) != 1:
        rows = rows.reshape(1, -1, width).contiguous()
    blocks, inner, _ = rows.shape
    if blocks * inner:
        block = triton.next_power_of_2(width)
        grid = (blocks * inner,)
        args = (width, rows.stride(0), rows.stride(1), inner)
        compiled = _row_statistics_kernel[grid](rows, out, *args, STATS=stats, BLOCK=block,
                                                num_warps=min(16, max(4, block // 512)))
        # A view read where it lies (not a copy made for this call); Triton's interpreter gives no kernel.
        if compiled is not None and rows is given and aligned:
            launch = compiled[(grid[0], 1, 1)]  # a compiled kernel's launcher takes all three dimensions
            _repeatable = (given, stats, lambda into: launch(given, into, *args, stats, block))
    return out
