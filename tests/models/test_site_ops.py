"""The site op alone: what it writes (patching), adds (steering) and reads (capture), on plain tensors."""

import pytest
import torch

from vllm_interp.models.site_ops import STEP, StepReads, site

HIDDEN = 8
LAYER = 2
NO_PATCH = (torch.zeros(3, 1, dtype=torch.long), torch.zeros(1, HIDDEN), torch.zeros(1), None)
# Graph read buffers of an engine whose graphs never read (eager steps read through STEP.reads).
NO_GRAPH_READS = (torch.full((1,), -1, dtype=torch.long), torch.zeros(3, dtype=torch.int32), torch.zeros(3, 0, HIDDEN))


def _run(hidden, residual, *, rows=None, sites=((LAYER, 1),), index=None, table=None, hook=1, patch=NO_PATCH,
         hidden_in_use=False):
    """One site op call at (LAYER, hook), as an eager step runs it; returns what it read (None: nothing).
    ``patch``: what ``_patch`` builds."""
    tokens = hidden.reshape(-1, HIDDEN).shape[0]
    index = torch.zeros(tokens, dtype=torch.long) if index is None else index
    table = torch.zeros(3, 1, HIDDEN) if table is None else table
    reads = None if rows is None else StepReads(rows, frozenset(sites))
    *buffers, planned = patch
    STEP.reads, STEP.steer, STEP.patch = reads, frozenset({(LAYER, hook)} if table.shape[1] > 1 else ()), planned
    try:
        site(hidden, residual, index, table, *buffers, *NO_GRAPH_READS, LAYER, hook, hidden_in_use)
    finally:
        STEP.reads, STEP.steer, STEP.patch = None, frozenset(), None
    return None if reads is None else reads.out.get((LAYER, hook))


def _patch(tokens: int, rows: dict[int, tuple[torch.Tensor, float]], hook: int = 1):
    """Patch buffers putting ``rows`` (token row -> (value, alpha)) at ``hook``: the index ``[3, tokens]``, the
    value table, the alphas (what a CUDA graph reads), and the step's plan for the site (what an eager step
    reads), as the runner fills both (tests/gpu/test_site_kernel.py holds the graph kernel to the eager op)."""
    index = torch.zeros(3, tokens, dtype=torch.long)
    values, alphas = torch.zeros(len(rows) + 1, HIDDEN), torch.zeros(len(rows) + 1)
    for slot, (row, (value, alpha)) in enumerate(rows.items(), start=1):
        index[hook, row], values[slot], alphas[slot] = slot, value, alpha
    planned = {(LAYER, hook): (torch.tensor(list(rows)), values[1:], alphas[1:])}
    return index, values, alphas, planned


@pytest.mark.parametrize("pair", [False, True])
def test_a_full_patch_copies_the_source_exactly_and_leaves_other_rows_untouched(pair):
    hidden, residual = torch.randn(5, HIDDEN), torch.randn(5, HIDDEN) if pair else None
    before = (hidden.clone(), residual.clone() if pair else None)
    source = torch.randn(HIDDEN)
    out = _run(hidden, residual, rows=torch.tensor([3, 1]), patch=_patch(5, {3: (source, 1.0)}))
    assert torch.equal(out[0], source)  # a read at the same site sees the patched stream
    stream = hidden + residual if pair else hidden
    assert torch.equal(stream[3], source)
    for row in (0, 1, 2, 4):  # bit for bit, both halves of a pair
        assert torch.equal(hidden[row], before[0][row])
        if pair:
            assert torch.equal(residual[row], before[1][row])
    if pair:  # the true stream moves into the residual: later fused add+norm kernels see exactly the source
        assert torch.equal(hidden[3], torch.zeros(HIDDEN)) and torch.equal(residual[3], source)


def test_alpha_interpolates_between_the_stream_and_the_source():
    hidden = torch.randn(3, HIDDEN)
    x, source = hidden[1].clone(), torch.randn(HIDDEN)
    _run(hidden, None, patch=_patch(3, {1: (source, 0.25)}))
    torch.testing.assert_close(hidden[1], 0.75 * x + 0.25 * source)
    unpatched = hidden.clone()
    _run(hidden, None, patch=_patch(3, {1: (source, 0.0)}))
    assert torch.equal(hidden, unpatched)


def test_a_patch_where_the_layer_reads_hidden_again_writes_the_residual_alone():
    hidden, residual = torch.randn(2, HIDDEN), torch.randn(2, HIDDEN)
    kept, source = hidden.clone(), torch.randn(HIDDEN)
    _run(hidden, residual, patch=_patch(2, {0: (source, 1.0)}), hidden_in_use=True)
    assert torch.equal(hidden, kept)
    torch.testing.assert_close(hidden[0] + residual[0], source, rtol=0, atol=1e-6)


def test_patch_then_steer_then_read():
    hidden = torch.randn(2, HIDDEN)
    source = torch.randn(HIDDEN)
    table = torch.zeros(3, 2, HIDDEN)
    table[1, 1] = 1.0
    out = _run(hidden, None, rows=torch.tensor([0]), index=torch.tensor([1, 0]), table=table,
               patch=_patch(2, {0: (source, 1.0)}))
    assert torch.equal(out[0], source + 1.0)


def test_reads_the_sum_of_the_deferred_pair_at_planned_rows_only():
    hidden, residual = torch.randn(6, HIDDEN), torch.randn(6, HIDDEN)
    out = _run(hidden, residual, rows=torch.tensor([5, 2]))
    assert out.shape == (2, HIDDEN)
    assert torch.equal(out[0], hidden[5] + residual[5]) and torch.equal(out[1], hidden[2] + residual[2])


def test_sites_nobody_wants_and_steps_without_reads_read_nothing():
    assert _run(torch.randn(6, HIDDEN), None, rows=torch.tensor([1]), sites=[(LAYER, 0), (LAYER + 1, 1)]) is None
    assert _run(torch.randn(6, HIDDEN), None) is None


def test_batched_transformers_layout_is_flattened():
    hidden = torch.randn(1, 6, HIDDEN)
    out = _run(hidden, None, rows=torch.tensor([4]))
    assert torch.equal(out[0], hidden[0, 4])


def test_a_read_row_is_a_copy_that_in_place_kernels_cannot_change():
    hidden, residual = torch.randn(6, HIDDEN), torch.randn(6, HIDDEN)
    out = _run(hidden, residual, rows=torch.tensor([3]))
    expected = (hidden[3] + residual[3]).clone()
    # What vLLM's fused add+RMSNorm does next: residual <- hidden + residual, hidden <- norm(residual).
    residual.add_(hidden)
    hidden.copy_(residual * torch.rsqrt(residual.pow(2).mean(-1, keepdim=True) + 1e-6))
    assert torch.equal(out[0], expected)


@pytest.mark.parametrize("pair", [True, False])
def test_steering_adds_the_tokens_table_row_then_reads_the_steered_stream(pair):
    hidden, residual = torch.randn(4, HIDDEN), torch.randn(4, HIDDEN) if pair else None
    before_hidden = hidden.clone()
    before_stream = hidden + residual if pair else hidden.clone()
    table = torch.zeros(3, 3, HIDDEN)
    table[1, 1], table[1, 2] = 1.0, -2.0
    out = _run(hidden, residual, rows=torch.tensor([0, 1, 2, 3]), index=torch.tensor([0, 1, 2, 0]), table=table)
    delta = torch.stack([table[1, 0], table[1, 1], table[1, 2], table[1, 0]])
    # hidden + (residual + delta): equal to the steered stream up to float addition order.
    torch.testing.assert_close(out, before_stream + delta, rtol=0, atol=1e-6)
    if pair:  # the deferred pair is steered through the residual; hidden stays as it was
        assert torch.equal(hidden, before_hidden)
    assert torch.equal(out[0], before_stream[0]) and torch.equal(out[3], before_stream[3])


def test_the_op_survives_torch_compile_and_sees_each_steps_plan():
    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("index", torch.zeros(6, dtype=torch.long), persistent=False)
            self.register_buffer("table", torch.zeros(3, 2, HIDDEN), persistent=False)
            *buffers, self.planned = _patch(6, {2: (torch.ones(HIDDEN), 1.0)}, hook=0)
            for name, tensor in zip(("patch_index", "patch_values", "patch_alpha"), buffers, strict=True):
                self.register_buffer(name, tensor, persistent=False)

        def forward(self, x):
            x = x * 1.0
            site(x, None, self.index, self.table, self.patch_index, self.patch_values, self.patch_alpha,
                 *NO_GRAPH_READS, LAYER, 0, False)
            return x * 2

    layer = Layer()
    compiled = torch.compile(layer, fullgraph=True)
    for row, shift in ((1, 0.0), (4, 3.0)):
        x = torch.randn(6, HIDDEN)
        layer.table[0, 1] = shift
        layer.index.fill_(1)
        reads = StepReads(torch.tensor([row]), frozenset({(LAYER, 0)}))
        layer.planned[(LAYER, 0)][1][0] = shift  # each step's plan, seen by the compiled graph
        STEP.reads, STEP.steer, STEP.patch = reads, frozenset({(LAYER, 0)}), layer.planned
        y = compiled(x)
        STEP.reads, STEP.steer, STEP.patch = None, frozenset(), None
        expected = x + shift
        expected[2] = 2 * shift
        assert torch.equal(reads.out[(LAYER, 0)][0], expected[row])
        assert torch.equal(y, expected * 2)


def test_the_next_layers_pre_attn_takes_the_post_block_rows_of_the_same_unchanged_stream():
    """post_block of layer L and pre_attn of L + 1 are one point of the stream: an eager step reads it once,
    unless the next layer is handed other tensors (a model that computes between its layers) or its pre_attn
    site steers the stream."""
    post_block, pre_attn = (LAYER, 2), (LAYER + 1, 0)
    no_steering, no_index = torch.zeros(3, 1, HIDDEN), torch.zeros(4, dtype=torch.long)

    def step(new_tensors: bool = False, steer_pre_attn: bool = False, patch_pre_attn: bool = False):
        hidden, residual = torch.randn(4, HIDDEN), torch.randn(4, HIDDEN)
        reads = StepReads(torch.tensor([1, 3]), frozenset({post_block, pre_attn}))
        table, index = no_steering, no_index
        if steer_pre_attn:
            table, index = torch.zeros(3, 2, HIDDEN), torch.tensor([0, 1, 0, 1])
            table[0, 1] = 5.0
        STEP.reads, STEP.patch = reads, None
        try:
            STEP.steer = frozenset()
            site(hidden, residual, no_index, no_steering, *NO_PATCH[:3], *NO_GRAPH_READS, *post_block, False)
            if new_tensors:
                residual = residual + 1.0
            STEP.steer = frozenset({pre_attn} if steer_pre_attn else ())
            if patch_pre_attn:  # row 3 becomes zeros
                STEP.patch = {pre_attn: (torch.tensor([3]), torch.zeros(1, HIDDEN), torch.ones(1))}
            site(hidden, residual, index, table, *NO_PATCH[:3], *NO_GRAPH_READS, *pre_attn, False)
        finally:
            STEP.reads, STEP.steer, STEP.patch = None, frozenset(), None
        return reads.out, (hidden + residual)[[1, 3]]

    out, stream = step()
    assert out[pre_attn] is out[post_block] and torch.equal(out[pre_attn], stream)
    out, stream = step(new_tensors=True)
    assert out[pre_attn] is not out[post_block] and torch.equal(out[pre_attn], stream)
    torch.testing.assert_close(out[post_block], stream - 1.0)  # read before the write
    out, stream = step(patch_pre_attn=True)
    assert torch.equal(out[pre_attn], stream) and not out[pre_attn][1].any() and out[post_block][1].any()
    out, stream = step(steer_pre_attn=True)
    assert torch.equal(out[pre_attn], stream)
    torch.testing.assert_close(out[pre_attn], out[post_block] + 5.0)
