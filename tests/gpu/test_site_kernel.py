"""The site op's CUDA-graph kernel compiled on the GPU against the eager op, in bf16 and float32
(tests/models/site_kernel_cases.py)."""

import pytest
import torch

from tests.gpu.modes import print_figure
from tests.models.site_kernel_cases import (
    eager_steering_adds_the_indexed_rows,
    kernel_leaves_unnamed_rows_alone,
    kernel_matches_eager,
)

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("pair", "hidden_in_use"), [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("width", [576, 2050])
def test_the_graph_kernel_writes_steers_and_reads_as_the_eager_op_does(dtype, pair, hidden_in_use, width):
    worst = kernel_matches_eager(CUDA, dtype, pair, hidden_in_use, width)
    print_figure(f"site kernel vs eager op ({dtype}, pair={pair}, hidden_in_use={hidden_in_use}, width={width})",
                 f"alpha 0/1, steered and read rows bit-identical; alpha 0.3/0.7 rows {worst:.2e} relative")


def test_the_graph_kernel_reads_nothing_when_the_sites_flag_is_clear_and_leaves_unnamed_rows_alone():
    kernel_leaves_unnamed_rows_alone(CUDA)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("width", [576, 2050])
def test_eager_steering_on_the_gpu_adds_each_rows_table_row_as_the_gather_and_add_does(dtype, width):
    relaunched = eager_steering_adds_the_indexed_rows(CUDA, dtype, width)
    # Width 576's rows and tables start 16-byte aligned: the second launch reuses the first one's kernel.
    assert relaunched == (width == 576)
