"""The inline consumer's HTTP form: the safetensors file it writes directly from a result's packed block reads
back, through safetensors itself, as the tensors and header that safetensors' own ``save`` would have written."""

import base64
import json

import pytest
import torch
from safetensors.torch import load, save

from vllm_interp.capture.consumers.inline import METADATA_KEY, ResidualReadout, safetensors_blob


def _data_start(blob: bytes) -> int:
    return 8 + int.from_bytes(blob[:8], "little")


def _header(blob: bytes) -> dict:
    return json.loads(blob[8 : _data_start(blob)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("positions", [[3, 7, 9], []])
def test_blob_reads_as_safetensors_own(dtype, positions):
    sites = ["0.pre_attn", "0.post_block", "11.post_attn"]
    tensors = {site: torch.randn(len(positions), 6).to(dtype) for site in sites}
    result = ResidualReadout(positions, tensors, {"positions": positions, "request_id": "r"}).to_result()
    blob = safetensors_blob(result)
    own = save(tensors, metadata={METADATA_KEY: json.dumps(result["metadata"])})
    assert _data_start(blob) % 8 == 0  # 8-byte aligned, as safetensors writes it
    loaded, expected = load(blob), load(own)
    assert sorted(loaded) == sorted(expected)
    for site in sites:
        assert loaded[site].dtype == dtype and torch.equal(loaded[site], tensors[site])
    assert _header(blob)["__metadata__"] == _header(own)["__metadata__"]
    back = ResidualReadout.from_result({"safetensors": base64.b64encode(blob).decode()})  # as HTTP carries it
    assert back.positions == positions and list(back.tensors) == sites


def test_blob_of_no_sites():
    result = ResidualReadout([], {}, {"positions": []}).to_result()
    assert load(safetensors_blob(result)) == {}

