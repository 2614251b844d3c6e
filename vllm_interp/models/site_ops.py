"""The opaque custom op every hook site calls, registered once per process.

``vllm_interp::site`` does three things to the residual stream at one (layer, hook), in this order:

1. **write** (patching): each patched row becomes ``lerp(x, source, alpha)``; alpha 1 is a bit-exact copy
   of the source, and other rows are untouched bit for bit;
2. **steer**: add ``steer_table[hook, steer_index[row]]`` to every row, in place (row 0 of the table is
   zeros, so unsteered rows are unchanged bit for bit);
3. **read**: when this step captures the site, copy the planned rows out.

Run eagerly, the op acts on what the runner planned for the step in ``STEP`` (the patched rows, the sites
anything is steered at, the rows to read, which it hands back as new tensors in ``STEP.reads``; on CUDA its
steering add is one launch of the graph kernel with steering alone). Captured in a CUDA graph, it launches
one kernel (site_kernel.py) that acts on every row as the persistent buffers say, which the runner fills before
every step, so replays patch, steer and read too: row ``r`` takes patch slot
``patch_index[hook, r]`` of ``patch_values``/``patch_alpha`` (slot 0: unpatched) and steering row
``steer_index[r]``, and is read into row ``read_slot[r]`` of ``read_out[hook]`` (-1: not read) when
``read_flags[hook]`` is set. ``read_out`` holds ``--max-graph-capture-rows`` rows; a step reading more runs
eagerly.

The stream is given as vLLM carries it: one tensor, or the deferred ``(hidden_states, residual)`` pair whose
sum is the true stream; steering adds to ``residual`` when there is one (the layer's later fused add+norm
folds it in), else to ``hidden``. A write sets the true stream: a patched row of a pair becomes
``(0, value)``, so every later op (fused add+norm, the MLP's residual add) and a read at the same site see
exactly ``value``. Where the layer still uses ``hidden`` after the site (``hidden_in_use``: GPT-NeoX's
parallel residual, whose MLP reads the layer input) the write goes to ``residual`` alone, as
``value - hidden`` (exact to one rounding). Reads gather the planned rows first, so a read is a copy that
the fused kernels updating ``residual`` in place later cannot change.

Why an opaque op: vLLM traces the model once and drops Dynamo guards, so Python state read at trace time
would be frozen into the graph. The op's body runs on every step instead. Everything a graph replay uses is
a module buffer the runner updates in place (``copy_``), which the compiled graph sees as an input. Declared
mutations keep Inductor from dropping the call.
"""

from dataclasses import dataclass, field

import torch

from vllm_interp.hooks import POST_BLOCK, PRE_ATTN


@dataclass
class StepReads:
    """The reads of one step: token rows (on the device) and the sites some request captures."""

    rows: torch.Tensor  # [num_rows] token row of each read slot
    sites: frozenset[tuple[int, int]]  # (layer, hook index)
    out: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # site -> [num_rows, hidden]
    # An eager step's last post_block read: its layer and the stream tensors it read. The next layer's pre_attn
    # site sees that point of the stream when it is handed the same tensors (``_reread``).
    post_block: tuple[int, torch.Tensor, torch.Tensor | None] | None = None


# (layer, hook) -> (token rows, source values [rows, hidden], alphas [rows]) of one step's patches.
StepPatches = dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass
class StepState:
    """Host-side facts about the current step, set by the runner before each forward. A step that reads or
    steers nothing costs one early return per site."""

    reads: StepReads | None = None
    # (layer, hook) sites the step adds steering at: those some config or the global vectors steer (every
    # table row a token can take is zeros elsewhere).
    steer: frozenset[tuple[int, int]] = frozenset()
    patch: StepPatches | None = None


STEP = StepState()


def _capturing(tensor: torch.Tensor) -> bool:
    return tensor.is_cuda and torch.cuda.is_current_stream_capturing()


def _flat(hidden: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The stream as ``[tokens, hidden]`` views (the tensors themselves when they are that already, as vLLM's
    decoder layers pass them: a view is a torch call, which gives up the interpreter lock, at every site)."""
    if hidden.dim() == 2 and (residual is None or residual.dim() == 2):
        return hidden, residual
    width = hidden.shape[-1]
    return hidden.view(-1, width), None if residual is None else residual.view(-1, width)


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


def _site(
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    steer_index: torch.Tensor,
    steer_table: torch.Tensor,
    patch_index: torch.Tensor,
    patch_values: torch.Tensor,
    patch_alpha: torch.Tensor,
    read_slot: torch.Tensor,
    read_flags: torch.Tensor,
    read_out: torch.Tensor,
    layer: int,
    hook: int,
    hidden_in_use: bool,
) -> None:
    if _capturing(hidden):
        flat_hidden, flat_residual = _flat(hidden, residual)
        # One-row tables (steering, patch values) and a zero-row read buffer mean the feature is off on this
        # engine: the kernel is built without it, and with nothing on, not launched at all.
        patching, steering, reading = patch_values.shape[0] > 1, steer_table.shape[1] > 1, read_out.shape[1] > 0
        if patching or steering or reading:
            from vllm_interp.models.site_kernel import site_in_graph

            tokens = flat_hidden.shape[0]
            site_in_graph(flat_hidden, flat_residual, steer_index, steer_table[hook] if steering else None,
                          patch_index[hook, :tokens] if patching else None, patch_values, patch_alpha,
                          read_slot if reading else None, read_flags[hook : hook + 1], read_out[hook], hidden_in_use)
        return
    # Eagerly: decided from the step's plan before any tensor call (each gives up the interpreter lock), so a
    # site the step leaves alone costs a few dictionary and set lookups.
    site = (layer, hook)
    planned = STEP.patch.get(site) if STEP.patch is not None else None
    steered = site in STEP.steer
    reads = STEP.reads
    read = reads is not None and site in reads.sites
    if planned is None and not steered and not read:
        return
    flat_hidden, flat_residual = _flat(hidden, residual)
    if planned is not None:
        _write_rows(flat_hidden, flat_residual, *planned, hidden_in_use)
    target = flat_hidden if residual is None else flat_residual
    if steered:
        _steer(target, steer_index, steer_table[hook])
    if not read:
        return
    if hook == PRE_ATTN and planned is None and not steered:
        same = _reread(reads, layer, hidden, residual)
        if same is not None:
            reads.out[site] = same
            return
    picked = flat_hidden.index_select(0, reads.rows)
    if flat_residual is not None:
        picked.add_(flat_residual.index_select(0, reads.rows))
    reads.out[site] = picked
    if hook == POST_BLOCK:
        reads.post_block = (layer, hidden, residual)


def _reread(reads: StepReads, layer: int, hidden: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor | None:
    """The rows the previous layer's post_block site read, when this pre_attn site (which writes and steers
    nothing this step: the caller checks) is handed the very tensors that site read: the two sites are then one
    point of the stream (a decoder layer's output is the next one's input, and the models' layer loops write it
    nowhere in between: the post_block site is the last call of one hooked layer, pre_attn the first of the
    next), so an all-site capture gathers it once. Identity, not version counters: inference tensors keep none.
    None otherwise: new tensors in between, or another pipeline stage holding the previous layer."""
    last = reads.post_block
    if last is None or last[0] != layer - 1 or last[1] is not hidden or last[2] is not residual:
        return None
    return reads.out[(layer - 1, POST_BLOCK)]


def _steer(target: torch.Tensor, steer_index: torch.Tensor, table: torch.Tensor) -> None:
    """Add each row's steering vector in place (row 0 of ``table`` is zeros: unsteered rows stay as they are)."""
    if target.is_cuda:
        from vllm_interp.models.site_kernel import steer_in_place

        steer_in_place(target, steer_index, table)
    else:
        target.add_(table.index_select(0, steer_index[: target.shape[0]]))


def warm_eager_steering(steer_index: torch.Tensor, steer_table: torch.Tensor) -> None:
    """Build the eager steering kernel now (a first Triton call compiles it: about half a second of the forward
    thread, during which no step runs), on a row of zeros that row 0 of the table leaves as it is. ``steer_table``:
    the bank's ``[layers, hooks, rows, width]`` tables (one row: steering is off, nothing to build)."""
    if steer_table.is_cuda and steer_table.shape[2] > 1:
        _steer(torch.zeros(1, steer_table.shape[-1], dtype=steer_table.dtype, device=steer_table.device),
               steer_index, steer_table[0, 0])


def _site_fake(hidden, residual, steer_index, steer_table, patch_index, patch_values, patch_alpha, read_slot,
               read_flags, read_out, layer, hook, hidden_in_use) -> None:
    return None


def _register() -> None:
    if hasattr(torch.ops.vllm_interp, "site"):
        return
    lib = torch.library.Library("vllm_interp", "FRAGMENT")  # noqa: TOR901 - lives for the process
    lib.define(
        "site(Tensor(a!) hidden, Tensor(b!)? residual, Tensor steer_index, Tensor steer_table, "
        "Tensor patch_index, Tensor patch_values, Tensor patch_alpha, Tensor read_slot, Tensor read_flags, "
        "Tensor(c!) read_out, int layer, int hook, bool hidden_in_use) -> ()"
    )
    lib.impl("site", _site, "CompositeExplicitAutograd")
    torch.library.register_fake("vllm_interp::site", _site_fake, lib=lib)
    _LIBS.append(lib)


_LIBS: list[torch.library.Library] = []
_register()
site = torch.ops.vllm_interp.site
