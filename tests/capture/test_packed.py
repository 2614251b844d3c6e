"""Tensors packed as bytes for the trip from a consumer to its caller come back equal."""

import pickle

import pytest
import torch

from vllm_interp.capture.packed import pack, unpack


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(3, 5, 4), (2, 0, 4), ()])
def test_round_trip(dtype, shape):
    tensor = torch.randn(shape).to(dtype)
    packed = pickle.loads(pickle.dumps(pack(tensor)))  # as a process hop carries it
    assert isinstance(packed["data"], bytes)
    back = unpack(packed)
    assert back.dtype == dtype and back.shape == tensor.shape
    assert torch.equal(back, tensor)


def test_views_pack_their_own_elements():
    block = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    assert torch.equal(unpack(pack(block[:, 1])), block[:, 1])
    assert torch.equal(unpack(pack(block.transpose(0, 2))), block.transpose(0, 2))


def test_a_tensor_that_requires_grad_packs_its_values():
    tensor = torch.randn(2, 3, requires_grad=True)
    assert torch.equal(unpack(pack(tensor)), tensor.detach())
