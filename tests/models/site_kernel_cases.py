"""The site op's CUDA-graph kernel (site_kernel.py) against the eager op on the same buffers, for any device:
the GPU tests run it compiled (tests/gpu/test_site_kernel.py), the CPU tests through Triton's interpreter
(tests/models/test_site_kernel.py). Patched, steered and read rows equal bit for bit (one rounding apart for
alphas other than 0 and 1), and rows the buffers do not name are untouched."""

import torch

from vllm_interp.models.site_kernel import _STEERING_KERNELS, _steering_key, site_in_graph, steer_in_place
from vllm_interp.models.site_ops import STEP, StepReads, site

TOKENS, HOOK, LAYER = 9, 1, 3
PATCHES = {1: 1.0, 3: 0.0, 4: 0.3, 6: 0.7, 8: 1.0}  # token row -> alpha
STEER_INDEX = [0, 2, 1, 0, 2, 0, 1, 2, 0]  # token row -> steering table row (rows 0 and 5: only read or nothing)
READ_ROWS = [6, 1, 0, 8]  # read slot -> token row


def _buffers(device: torch.device, width: int, dtype: torch.dtype, pair: bool):
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

    hidden, residual = randn(TOKENS, width), randn(TOKENS, width) if pair else None
    table = randn(3, 3, width)
    table[:, 0] = 0  # row 0: unsteered
    patch_index = torch.zeros(3, TOKENS, dtype=torch.long, device=device)
    values, alphas = randn(len(PATCHES) + 1, width), torch.zeros(len(PATCHES) + 1, dtype=dtype, device=device)
    for slot, (row, alpha) in enumerate(PATCHES.items(), start=1):
        patch_index[HOOK, row], alphas[slot] = slot, alpha
    steer_index = torch.tensor(STEER_INDEX, device=device)
    return hidden, residual, steer_index, table, patch_index, values, alphas


def _eager(hidden, residual, steer_index, table, patch_index, values, alphas, hidden_in_use):
    """The eager op, as a step that planned the same patches, steering and reads runs it."""
    device = hidden.device
    rows = torch.tensor(list(PATCHES), device=device)
    slots = patch_index[HOOK, rows]
    planned = {(LAYER, HOOK): (rows, values.index_select(0, slots), alphas.index_select(0, slots))}
    reads = StepReads(torch.tensor(READ_ROWS, device=device), frozenset({(LAYER, HOOK)}))
    no_graph_reads = (torch.full((1,), -1, dtype=torch.long, device=device),
                      torch.zeros(3, dtype=torch.int32, device=device),
                      torch.zeros(3, 0, hidden.shape[1], device=device))
    STEP.reads, STEP.steer, STEP.patch = reads, frozenset({(LAYER, HOOK)}), planned
    try:
        site(hidden, residual, steer_index, table, patch_index, values, alphas, *no_graph_reads, LAYER, HOOK,
             hidden_in_use)
    finally:
        STEP.reads, STEP.steer, STEP.patch = None, frozenset(), None
    return reads.out[(LAYER, HOOK)]


def _kernel(hidden, residual, steer_index, table, patch_index, values, alphas, hidden_in_use, read: bool):
    device = hidden.device
    read_slot = torch.full((TOKENS,), -1, dtype=torch.long, device=device)
    read_slot[torch.tensor(READ_ROWS, device=device)] = torch.arange(len(READ_ROWS), device=device)
    read_out = torch.full((len(READ_ROWS) + 2, hidden.shape[1]), 7.0, dtype=hidden.dtype, device=device)
    flag = torch.tensor([int(read)], dtype=torch.int32, device=device)
    site_in_graph(hidden, residual, steer_index, table[HOOK], patch_index[HOOK], values, alphas, read_slot, flag,
                  read_out, hidden_in_use)
    return read_out


def kernel_matches_eager(device: torch.device, dtype: torch.dtype, pair: bool, hidden_in_use: bool,
                         width: int) -> float:
    """Assert the kernel's writes, steering and reads equal the eager op's; returns the worst relative
    difference of the rows patched with alphas other than 0 and 1."""
    buffers = _buffers(device, width, dtype, pair)
    eager_in = [b.clone() if b is not None else None for b in buffers]
    kernel_in = [b.clone() if b is not None else None for b in buffers]
    eager_out = _eager(*eager_in, hidden_in_use)
    read_out = _kernel(*kernel_in, hidden_in_use, read=True)
    exact = [row for row in range(TOKENS) if PATCHES.get(row, 1.0) in (0.0, 1.0)]
    rounded = [row for row in range(TOKENS) if row not in exact]
    worst = 0.0
    for name, a, b in (("hidden", eager_in[0], kernel_in[0]), ("residual", eager_in[1], kernel_in[1])):
        if a is None:
            continue
        assert torch.equal(a[exact], b[exact]), name
        # Other alphas: the same formula, one float32 rounding apart at most (fused multiply-add placement).
        eps = torch.finfo(dtype).eps
        diff = ((a[rounded].float() - b[rounded].float()).abs() / (a[rounded].float().abs() + 1)).max().item()
        worst = max(worst, diff)
        assert diff <= 2 * eps, (name, diff)
    slots_exact = [slot for slot, row in enumerate(READ_ROWS) if row in exact]
    assert torch.equal(read_out[slots_exact], eager_out[slots_exact])
    assert (read_out[len(READ_ROWS):] == 7).all()  # slots no row maps to are untouched
    return worst


def kernel_leaves_unnamed_rows_alone(device: torch.device) -> None:
    """With no row patched or steered and the site's read flag clear, nothing is written anywhere."""
    hidden, residual, steer_index, table, patch_index, values, alphas = _buffers(device, 576, torch.bfloat16, True)
    steer_index.zero_()
    patch_index.zero_()
    before = (hidden.clone(), residual.clone())
    read_out = _kernel(hidden, residual, steer_index, table, patch_index, values, alphas, False, read=False)
    assert torch.equal(hidden, before[0]) and torch.equal(residual, before[1])
    assert (read_out == 7).all()


def eager_steering_adds_the_indexed_rows(device: torch.device, dtype: torch.dtype, width: int) -> bool:
    """The eager op's steering on CUDA (``steer_in_place``) adds each row's table row as the gather-and-add does,
    bit for bit (rows 0 and 5 take row 0: unsteered); then again on another stream, shorter, with another hook's
    table, as the next steered site of an eager step would: on a GPU, where the pointers are aligned, through the
    kernel compiled for the first launch, launched directly. Returns whether the second launch went so."""
    hidden, _, steer_index, table, *_ = _buffers(device, width, dtype, False)
    expected = hidden + table[HOOK].index_select(0, steer_index)
    steer_in_place(hidden, steer_index, table[HOOK])
    assert torch.equal(hidden, expected)
    again, index, other_table = hidden[:5].clone(), steer_index[:5], table[HOOK + 1]
    expected = again + other_table.index_select(0, index)
    key = _steering_key(again, index, other_table)
    relaunched = key is not None and key in _STEERING_KERNELS
    steer_in_place(again, index, other_table)
    assert torch.equal(again, expected)
    return relaunched
