"""``logging``'s one-launch statistics kernel (GPU engines) computes what the torch reduction computes, of
contiguous blocks and of views it reads in place, into a tensor of its own or a given one: checked here on the
CPU through Triton's interpreter (set before the kernel is built, so in a process of its own)."""

import os
import subprocess
import sys

CHECK = """
import torch
from vllm_interp.capture.consumers.logging import STATS, row_statistics
from vllm_interp.capture.consumers.statistics_kernel import row_statistics_kernel

torch.manual_seed(0)
for shape, dtype in [((3, 5, 576), torch.float32), ((2, 7, 2048), torch.bfloat16), ((1, 1, 100), torch.float16),
                     ((2, 0, 64), torch.float32)]:
    rows = (torch.randn(shape) * 3 + 0.5).to(dtype)
    got = row_statistics_kernel(rows, len(STATS))
    torch.testing.assert_close(got, row_statistics(rows), rtol=1e-5, atol=1e-5)
# Views read where they lie: a replayed step's rows of consecutive layers in the graph read buffers
# ([layers, hooks, buffer rows, width]), a transposed block, and a single row.
buffers = torch.randn(4, 3, 9, 64)
for view in [buffers[1:3, :, :5].flatten(0, 1), buffers[0:4, 2, :7], buffers[:, :, 2].transpose(0, 1),
             buffers[1, 1, 3], buffers[:2, :2, :3, :10]]:
    torch.testing.assert_close(row_statistics_kernel(view, len(STATS)), row_statistics(view), rtol=1e-5, atol=1e-5)
# Into a given tensor (a step's slot of a block of steps, ``host_copies.ReducedSteps``), the rest untouched.
steps = torch.full((3, 2 * 5 * len(STATS) + 2), -7.0)
slot = steps[1, : 2 * 5 * len(STATS)].view(2, 5, len(STATS))
view = buffers[1:3, 1, :5]
assert row_statistics_kernel(view, len(STATS), slot) is slot
torch.testing.assert_close(slot, row_statistics(view), rtol=1e-5, atol=1e-5)
assert (steps[0] == -7).all() and (steps[2] == -7).all() and (steps[1, -2:] == -7).all()
print("ok")
"""


def test_the_kernel_equals_the_torch_statistics():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
