"""The steering tables on the GPU hold what they hold on the CPU, bit for bit: rows queued as configs arrive are
zeroed, converted to the table's dtype and scattered on the device (tests/steering/test_tables.py checks the CPU
tables against the vectors), and a reused slot keeps nothing of its last owner."""

import numpy as np
import pytest
import torch

from vllm_interp.hooks import HOOKS, site_name
from vllm_interp.models.registry import SiteBank
from vllm_interp.request_args import EXTRA_ARGS_KEY
from vllm_interp.steering.tables import SteeringTables, table_rows
from vllm_interp.steering.vectors import SteeringVectors

pytestmark = pytest.mark.gpu

HIDDEN, SLOTS = 2048, 8
HELD = [0, 1, 2, 3]  # layers 4 and 5 belong to another pipeline stage


def _requests() -> list[dict]:
    rng = np.random.default_rng(0)
    requests = []
    for i in range(12):
        tiers = {"base": {site_name(layer, hook): rng.standard_normal(HIDDEN).astype(np.float32)
                          for layer in range(6) for hook in HOOKS if rng.random() < 0.5}}
        if i % 3 == 0:
            tiers["decode"] = {site_name(1, "post_attn"): rng.standard_normal(HIDDEN).astype(np.float32)}
        vectors = SteeringVectors(tiers)
        requests.append({EXTRA_ARGS_KEY: {"steering": {"vectors": vectors.to_wire(), "digest": vectors.digest()}}})
    return requests


def _filled_table(device: str, dtype: torch.dtype, requests: list[dict]) -> torch.Tensor:
    bank = SiteBank.allocate(HELD, hidden_size=HIDDEN, dtype=dtype, device=torch.device(device), max_tokens=64,
                             steer_rows=table_rows(SLOTS), patch_slots=1, graph_read_rows=0)
    tables = SteeringTables(bank, SLOTS)
    tables.set_global(SteeringVectors({"base": {site_name(2, "pre_attn"): np.full(HIDDEN, 0.5, np.float32)}}))
    for i in range(6):
        tables.lookup(f"r{i}", requests[i])
    tables.load_index(np.zeros(10, np.int64))  # the step's index load writes the queued rows first
    tables.forget_finished({"r0", "r2", "r4"})  # three slots freed, then retaken by other vectors
    for i in range(6, 11):
        tables.lookup(f"r{i}", requests[i])
    tables.load_index(np.zeros(10, np.int64))
    return bank.steer_table


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_tables_equal_cpu_tables(dtype):
    requests = _requests()
    on_gpu = _filled_table("cuda", dtype, requests)
    torch.cuda.synchronize()
    assert torch.equal(on_gpu.cpu(), _filled_table("cpu", dtype, requests))
