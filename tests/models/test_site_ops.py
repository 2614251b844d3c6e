import torch

from vllm_interp.models import site_ops


def _read(hidden, residual, rows, count):
    out = torch.zeros(3, 4, hidden.shape[-1])
    site_ops.set_step_read_rows(count)
    try:
        site_ops.read_site(hidden, residual, rows, out, 1)
    finally:
        site_ops.set_step_read_rows(0)
    return out


def test_reads_the_sum_of_the_deferred_pair_at_planned_rows_only():
    hidden, residual = torch.randn(6, 8), torch.randn(6, 8)
    out = _read(hidden, residual, torch.tensor([5, 2, 3, 3]), count=2)
    assert torch.equal(out[1, 0], hidden[5] + residual[5])
    assert torch.equal(out[1, 1], hidden[2] + residual[2])
    assert not out[1, 2:].any() and not out[0].any() and not out[2].any()


def test_a_step_without_reads_touches_nothing():
    out = _read(torch.randn(6, 8), None, torch.tensor([1, 0, 0, 0]), count=0)
    assert not out.any()


def test_batched_transformers_layout_is_flattened():
    hidden = torch.randn(1, 6, 8)
    out = _read(hidden, None, torch.tensor([4, 0, 0, 0]), count=1)
    assert torch.equal(out[1, 0], hidden[0, 4])


def test_a_read_row_is_a_copy_that_in_place_kernels_cannot_change():
    hidden, residual = torch.randn(6, 8), torch.randn(6, 8)
    out = _read(hidden, residual, torch.tensor([3, 0, 0, 0]), count=1)
    expected = (hidden[3] + residual[3]).clone()
    # What vLLM's fused add+RMSNorm does next: residual <- hidden + residual, hidden <- norm(residual).
    residual.add_(hidden)
    hidden.copy_(residual * torch.rsqrt(residual.pow(2).mean(-1, keepdim=True) + 1e-6))
    assert torch.equal(out[1, 0], expected)


def test_the_op_survives_torch_compile_and_sees_buffer_updates():
    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("interp_rows", torch.zeros(4, dtype=torch.long), persistent=False)
            self.register_buffer("interp_out", torch.zeros(3, 4, 8), persistent=False)

        def forward(self, x):
            site_ops.read_site(x, None, self.interp_rows, self.interp_out, 0)
            return x * 2

    layer = Layer()
    compiled = torch.compile(layer, fullgraph=True)
    for row in (1, 4):
        x = torch.randn(6, 8)
        layer.interp_rows[0] = row
        site_ops.set_step_read_rows(1)
        compiled(x)
        site_ops.set_step_read_rows(0)
        assert torch.equal(layer.interp_out[0, 0], x[row])
