"""The opaque custom op every hook site calls, registered once per process.

``vllm_interp::site`` does two things to the residual stream at one (layer, hook), in this order:

1. **steer**: add ``steer_table[hook, steer_index[row]]`` to every row, in place (row 0 of the table is
   zeros, so unsteered rows are unchanged bit for bit);
2. **read**: when this step captures the site, copy the planned rows into ``STEP.reads``.

The stream is given as vLLM carries it: one tensor, or the deferred ``(hidden_states, residual)`` pair whose
sum is the true stream; steering adds to ``residual`` when there is one (the layer's later fused add+norm
folds it in), else to ``hidden``. Reads gather the planned rows first, so a read is a copy that the fused
kernels updating ``residual`` in place later cannot change.

Why an opaque op: vLLM traces the model once and drops Dynamo guards, so Python state read at trace time
would be frozen into the graph. The op's body runs on every step instead. Steering touches only module
buffers that the runner updates in place (``copy_``), which the compiled graph sees as inputs, so it also
works inside CUDA graphs. Reads hand new tensors to the host-side ``STEP`` record; a CUDA graph cannot do
that, so the op never reads while a graph is being captured, and the runner runs the steps that read
without graphs. Declared mutations keep Inductor from dropping the call.
"""

from dataclasses import dataclass, field

import torch


@dataclass
class StepReads:
    """The reads of one step: token rows (on the device) and the sites some request captures."""

    rows: torch.Tensor  # [num_rows] token row of each read slot
    sites: frozenset[tuple[int, int]]  # (layer, hook index)
    out: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # site -> [num_rows, hidden]


@dataclass
class StepState:
    """Host-side facts about the current step, set by the runner before each forward. A step that reads or
    steers nothing costs one early return per site."""

    reads: StepReads | None = None
    steer: bool = False


STEP = StepState()


def _capturing(tensor: torch.Tensor) -> bool:
    return tensor.is_cuda and torch.cuda.is_current_stream_capturing()


def _site(
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    steer_index: torch.Tensor,
    steer_table: torch.Tensor,
    layer: int,
    hook: int,
) -> None:
    capturing = _capturing(hidden)
    width = hidden.shape[-1]
    target = hidden if residual is None else residual
    # A one-row table holds only the zero row: steering is off for this engine.
    if (STEP.steer or capturing) and steer_table.shape[1] > 1:
        flat = target.view(-1, width)
        flat.add_(steer_table[hook].index_select(0, steer_index[: flat.shape[0]]))
    reads = STEP.reads
    if reads is None or capturing or (layer, hook) not in reads.sites:
        return
    picked = hidden.reshape(-1, width).index_select(0, reads.rows)
    if residual is not None:
        picked.add_(residual.reshape(-1, width).index_select(0, reads.rows))
    reads.out[(layer, hook)] = picked


def _site_fake(hidden, residual, steer_index, steer_table, layer, hook) -> None:
    return None


def _register() -> None:
    if hasattr(torch.ops.vllm_interp, "site"):
        return
    lib = torch.library.Library("vllm_interp", "FRAGMENT")  # noqa: TOR901 - lives for the process
    lib.define(
        "site(Tensor(a!) hidden, Tensor(b!)? residual, Tensor steer_index, Tensor steer_table, int layer, "
        "int hook) -> ()"
    )
    lib.impl("site", _site, "CompositeExplicitAutograd")
    torch.library.register_fake("vllm_interp::site", _site_fake, lib=lib)
    _LIBS.append(lib)


_LIBS: list[torch.library.Library] = []
_register()
site = torch.ops.vllm_interp.site
