"""The example third-party consumer in examples/capture_consumers/activation_stats, called directly."""

import importlib
import json
from pathlib import Path

import pytest
import torch

from vllm_interp.capture.consumer import CaptureMeta, ConsumerContext, EngineFacts, RequestCapture

PACKAGE = Path(__file__).resolve().parents[2] / "examples" / "capture_consumers" / "activation_stats"
SITES = ["3.post_block", "7.post_block"]


@pytest.fixture
def consumer_cls(monkeypatch):
    monkeypatch.syspath_prepend(str(PACKAGE))
    return importlib.import_module("activation_stats").ActivationStatsConsumer


def make_capture(positions: list[int], note: str | None = None) -> RequestCapture:
    generator = torch.Generator().manual_seed(0)
    meta = CaptureMeta(
        request_id="req-1",
        tag="exp/1",
        model="m",
        prompt_len=4,
        positions=positions,
        sites=SITES,
        dtype="torch.bfloat16",
        options={} if note is None else {"note": note},
    )
    tensors = {site: torch.randn(len(positions), 8, generator=generator).bfloat16() for site in SITES}
    return RequestCapture(meta=meta, tensors=tensors)


def run(consumer_cls, path: Path, *captures: RequestCapture) -> list[dict]:
    options = consumer_cls.validate_engine_options({"path": str(path)})
    context = ConsumerContext(name="activation_stats", options=options, model="m", num_layers=8, hidden_size=8)
    consumer = consumer_cls(context)
    try:
        return [consumer.consume(capture) for capture in captures]
    finally:
        consumer.close()


def test_appends_one_line_per_request(consumer_cls, tmp_path):
    path = tmp_path / "stats.jsonl"
    path.write_text('{"earlier": true}\n')
    capture = make_capture([2, 3], note=consumer_cls.validate_options({"note": "hello"}, EngineFacts(8))["note"])
    results = run(consumer_cls, path, capture, make_capture([]))
    assert results == [{"written": str(path), "sites": 2}] * 2

    earlier, line, empty = (json.loads(text) for text in path.read_text().splitlines())
    assert earlier == {"earlier": True}
    assert line["request_id"] == "req-1" and line["tag"] == "exp/1" and line["note"] == "hello"
    assert line["positions"] == [2, 3]
    assert list(line["mean_norm"]) == SITES
    for site in SITES:
        expected = capture.tensors[site].float().norm(dim=-1).mean().item()
        assert line["mean_norm"][site] == pytest.approx(expected)
    assert empty["note"] is None and empty["positions"] == []
    assert empty["mean_norm"] == dict.fromkeys(SITES)


@pytest.mark.parametrize(
    ("options", "field"),
    [({}, "path"), ({"path": ""}, "path"), ({"path": "/tmp/x", "mode": "w"}, "mode")],
)
def test_bad_engine_options_name_the_option(consumer_cls, options, field):
    with pytest.raises(ValueError, match=f"^{field}: "):
        consumer_cls.validate_engine_options(options)


@pytest.mark.parametrize(
    ("options", "field"),
    [({"note": 5}, "note"), ({"note": "x" * 201}, "note"), ({"colour": "red"}, "colour")],
)
def test_bad_request_options_name_the_option(consumer_cls, options, field):
    with pytest.raises(ValueError, match=f"^{field}: "):
        consumer_cls.validate_options(options, EngineFacts(8))


def test_note_is_optional(consumer_cls):
    assert consumer_cls.validate_options({}, EngineFacts(8)) == {}
    assert consumer_cls.validate_options({"note": "x" * 200}, EngineFacts(8)) == {"note": "x" * 200}
