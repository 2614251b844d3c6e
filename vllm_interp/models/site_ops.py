"""The opaque custom op every hook site calls, registered once per process.

``vllm_interp::site`` does three things to the residual stream at one (layer, hook), in this order:

1. **write** (patching): each patched row becomes ``lerp(x, source, alpha)``; alpha 1 is a bit-exact copy
   of the source, and other rows are untouched bit for bit. Run eagerly, the op writes the rows the runner
   planned for this site (``STEP.patch``); captured in a CUDA graph, it writes full width from the
   persistent buffers (row ``r`` takes slot ``patch_index[hook, r]`` of ``patch_values``/``patch_alpha``,
   slot 0 meaning unpatched), which the runner fills before every step, so replays patch too;
2. **steer**: add ``steer_table[hook, steer_index[row]]`` to every row, in place (row 0 of the table is
   zeros, so unsteered rows are unchanged bit for bit);
3. **read**: when this step captures the site, copy the planned rows into ``STEP.reads``.

The stream is given as vLLM carries it: one tensor, or the deferred ``(hidden_states, residual)`` pair whose
sum is the true stream; steering adds to ``residual`` when there is one (the layer's later fused add+norm
folds it in), else to ``hidden``. A write sets the true stream: a patched row of a pair becomes
``(0, value)``, so every later op (fused add+norm, the MLP's residual add) and a read at the same site see
exactly ``value``. Where the layer still uses ``hidden`` after the site (``hidden_in_use``: GPT-NeoX's
parallel residual, whose MLP reads the layer input) the write goes to ``residual`` alone, as
``value - hidden`` (exact to one rounding). Reads gather the planned rows first, so a read is a copy that
the fused kernels updating ``residual`` in place later cannot change.

Why an opaque op: vLLM traces the model once and drops Dynamo guards, so Python state read at trace time
would be frozen into the graph. The op's body runs on every step instead. Writes and steering touch only
module buffers that the runner updates in place (``copy_``), which the compiled graph sees as inputs, so
they also work inside CUDA graphs. Reads hand new tensors to the host-side ``STEP`` record; a CUDA graph cannot do
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


# (layer, hook) -> (token rows, source values [rows, hidden], alphas [rows]) of one step's patches.
StepPatches = dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass
class StepState:
    """Host-side facts about the current step, set by the runner before each forward. A step that reads or
    steers nothing costs one early return per site."""

    reads: StepReads | None = None
    steer: bool = False
    patch: StepPatches | None = None


STEP = StepState()


def _capturing(tensor: torch.Tensor) -> bool:
    return tensor.is_cuda and torch.cuda.is_current_stream_capturing()


def _write_rows(hidden: torch.Tensor, residual: torch.Tensor | None, rows: torch.Tensor, values: torch.Tensor,
                alphas: torch.Tensor, hidden_in_use: bool) -> None:
    """Patch ``rows`` of the flat ``[tokens, hidden]`` stream (eager steps: only the planned rows)."""
    stream = hidden.index_select(0, rows)
    if residual is not None:
        stream += residual.index_select(0, rows)
    value = torch.lerp(stream, values, alphas.unsqueeze(1))
    if residual is None:
        hidden.index_copy_(0, rows, value)
    elif hidden_in_use:
        residual.index_copy_(0, rows, value - hidden.index_select(0, rows))
    else:
        residual.index_copy_(0, rows, value)
        hidden.index_fill_(0, rows, 0)


def _write_all(hidden: torch.Tensor, residual: torch.Tensor | None, slots: torch.Tensor, values: torch.Tensor,
               alphas: torch.Tensor, hidden_in_use: bool) -> None:
    """Patch the rows whose slot is not 0, full width and branch-free: what a CUDA graph captures, so that a
    replay patches whatever rows the buffers name then."""
    patched = (slots > 0).unsqueeze(1)
    stream = hidden if residual is None else hidden + residual
    value = torch.lerp(stream, values.index_select(0, slots), alphas.index_select(0, slots).unsqueeze(1))
    if residual is None:
        hidden.copy_(torch.where(patched, value, hidden))
    elif hidden_in_use:
        residual.copy_(torch.where(patched, value - hidden, residual))
    else:
        residual.copy_(torch.where(patched, value, residual))
        hidden.masked_fill_(patched, 0)


def _site(
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    steer_index: torch.Tensor,
    steer_table: torch.Tensor,
    patch_index: torch.Tensor,
    patch_values: torch.Tensor,
    patch_alpha: torch.Tensor,
    layer: int,
    hook: int,
    hidden_in_use: bool,
) -> None:
    capturing = _capturing(hidden)
    width = hidden.shape[-1]
    flat_hidden = hidden.view(-1, width)
    flat_residual = None if residual is None else residual.view(-1, width)
    # A one-row value table holds only the unused slot 0: patching is off for this engine.
    if capturing and patch_values.shape[0] > 1:
        _write_all(flat_hidden, flat_residual, patch_index[hook, : flat_hidden.shape[0]], patch_values, patch_alpha,
                   hidden_in_use)
    elif STEP.patch is not None and (planned := STEP.patch.get((layer, hook))) is not None:
        _write_rows(flat_hidden, flat_residual, *planned, hidden_in_use)
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


def _site_fake(hidden, residual, steer_index, steer_table, patch_index, patch_values, patch_alpha, layer, hook,
               hidden_in_use) -> None:
    return None


def _register() -> None:
    if hasattr(torch.ops.vllm_interp, "site"):
        return
    lib = torch.library.Library("vllm_interp", "FRAGMENT")  # noqa: TOR901 - lives for the process
    lib.define(
        "site(Tensor(a!) hidden, Tensor(b!)? residual, Tensor steer_index, Tensor steer_table, "
        "Tensor patch_index, Tensor patch_values, Tensor patch_alpha, int layer, int hook, bool hidden_in_use) -> ()"
    )
    lib.impl("site", _site, "CompositeExplicitAutograd")
    torch.library.register_fake("vllm_interp::site", _site_fake, lib=lib)
    _LIBS.append(lib)


_LIBS: list[torch.library.Library] = []
_register()
site = torch.ops.vllm_interp.site
