"""A consumer's view of a captured block: its per-site tensors are the block's rows, made only when a consumer
asks for one, so a consumer that takes the block whole (``inline``) costs its runner thread no per-site calls."""

import pytest
import torch

from vllm_interp.capture.consumer import CaptureMeta, ConsumerContext, RequestCapture
from vllm_interp.capture.consumers.inline import InlineConsumer, ResidualReadout

SITES = ["0.pre_attn", "0.post_block", "3.post_attn"]


def _capture(block: torch.Tensor) -> RequestCapture:
    meta = CaptureMeta(request_id="r", tag=None, model="m", prompt_len=4, positions=[1, 3], sites=SITES,
                       dtype=str(block.dtype).removeprefix("torch."))
    return RequestCapture.of_block(meta, block)


def test_site_tensors_are_the_blocks_rows_in_site_order():
    block = torch.randn(len(SITES), 2, 5)
    capture = _capture(block)
    assert list(capture.tensors) == SITES and len(capture.tensors) == 3 and "3.post_attn" in capture.tensors
    for i, (site, tensor) in enumerate(capture):
        assert site == SITES[i] and torch.equal(tensor, block[i])
    assert torch.equal(capture.tensors["0.post_block"], block[1])
    assert capture.nbytes == block.numel() * 4
    with pytest.raises(KeyError):
        capture.tensors["9.post_block"]


def test_a_block_of_another_number_of_sites_is_refused():
    with pytest.raises(ValueError, match="3 site names for a block of 2 sites"):
        _capture(torch.zeros(2, 2, 5))


def test_the_inline_consumer_takes_the_block_without_per_site_tensors(monkeypatch):
    block = torch.randn(len(SITES), 2, 5).to(torch.bfloat16)
    consumer = InlineConsumer(ConsumerContext("inline", {}, "m", num_layers=4, hidden_size=5))

    def refuse(*args, **kwargs):
        raise AssertionError("per-site tensors were made")

    monkeypatch.setattr(torch.Tensor, "unbind", refuse)
    result = consumer.consume(_capture(block))
    monkeypatch.undo()
    readout = ResidualReadout.from_result(result)
    assert list(readout.tensors) == SITES
    for i, site in enumerate(SITES):
        assert torch.equal(readout[site], block[i])
