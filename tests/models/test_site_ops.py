import pytest
import torch

from vllm_interp.models.site_ops import STEP, StepReads, site

HIDDEN = 8
LAYER = 2


def _run(hidden, residual, *, rows=None, sites=((LAYER, 1),), index=None, table=None, hook=1):
    """One site op call at (LAYER, hook); returns what it read (None: nothing)."""
    tokens = hidden.reshape(-1, HIDDEN).shape[0]
    index = torch.zeros(tokens, dtype=torch.long) if index is None else index
    table = torch.zeros(3, 1, HIDDEN) if table is None else table
    reads = None if rows is None else StepReads(rows, frozenset(sites))
    STEP.reads, STEP.steer = reads, table.shape[1] > 1
    try:
        site(hidden, residual, index, table, LAYER, hook)
    finally:
        STEP.reads, STEP.steer = None, False
    return None if reads is None else reads.out.get((LAYER, hook))


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

        def forward(self, x):
            x = x * 1.0
            site(x, None, self.index, self.table, LAYER, 0)
            return x * 2

    layer = Layer()
    compiled = torch.compile(layer, fullgraph=True)
    for row, shift in ((1, 0.0), (4, 3.0)):
        x = torch.randn(6, HIDDEN)
        layer.table[0, 1] = shift
        layer.index.fill_(1)
        reads = StepReads(torch.tensor([row]), frozenset({(LAYER, 0)}))
        STEP.reads, STEP.steer = reads, True
        y = compiled(x)
        STEP.reads, STEP.steer = None, False
        assert torch.equal(reads.out[(LAYER, 0)][0], x[row] + shift)
        assert torch.equal(y, (x + shift) * 2)
