"""The logging consumer: statistics reduced from the rows (as the worker does on the device), logged and
returned."""

import base64
import json
import logging
from dataclasses import replace

import numpy as np
import pytest
import torch

from vllm_interp.capture.consumer import CaptureMeta, ConsumerContext, EngineFacts, RequestCapture
from vllm_interp.capture.consumers.logging import STATS, LoggingConsumer

LOGGER = "vllm_interp.capture.logging"
SITES = ["3.pre_attn", "3.post_block", "7.post_block"]


def make_capture(positions: list[int], hidden: int = 8, dtype: torch.dtype = torch.float32) -> RequestCapture:
    generator = torch.Generator().manual_seed(0)
    meta = CaptureMeta(
        request_id="req-1", tag="run/a", model="m", prompt_len=4, positions=positions, sites=SITES, dtype=str(dtype)
    )
    tensors = {site: torch.randn(len(positions), hidden, generator=generator).to(dtype) for site in SITES}
    return RequestCapture(meta=meta, tensors=tensors)


class ReducingConsumer:
    """A logging consumer fed as the worker feeds it: the rows' summaries, reduced by its ``row_reduction``."""

    def __init__(self, **options: str) -> None:
        validated = LoggingConsumer.validate_engine_options(options)
        self.consumer = LoggingConsumer(ConsumerContext(name="logging", options=validated, model="m", num_layers=8,
                                                        hidden_size=8))

    def consume_wire(self, capture: RequestCapture) -> dict:
        """The result as it leaves the consumer."""
        reduce = LoggingConsumer.row_reduction.reduce
        summaries = {site: reduce(rows) for site, rows in capture}
        assert all(t.dtype == torch.float32 for t in summaries.values())
        return self.consumer.consume(RequestCapture(replace(capture.meta, dtype="float32"), summaries))

    def consume(self, capture: RequestCapture) -> dict:
        """The result as the caller receives it."""
        return LoggingConsumer.result_from_wire(self.consume_wire(capture))



def test_defaults():
    assert LoggingConsumer.validate_engine_options({}) == {"level": "info", "max_positions": 16}
    assert LoggingConsumer.validate_engine_options({"level": "DEBUG", "max_positions": "3"}) == {
        "level": "debug",
        "max_positions": 3,
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stats_match_torch(dtype):
    capture = make_capture([1, 2, 3], dtype=dtype)
    result = ReducingConsumer().consume(capture)
    assert result["rows"] == 3 * len(SITES)
    assert list(result["stats"]) == SITES
    for site, rows in capture:
        rows = rows.float()
        expected = {
            "norm": rows.norm(dim=-1),
            "mean": rows.mean(dim=-1),
            "std": rows.std(dim=-1, unbiased=False),
            "min": rows.min(dim=-1).values,
            "max": rows.max(dim=-1).values,
        }
        stats = result["stats"][site]
        assert set(stats) == set(expected)
        for key, values in expected.items():
            assert all(type(v) is float for v in stats[key])
            torch.testing.assert_close(torch.tensor(stats[key]), values)


def test_logs_one_line_per_site(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    capture = make_capture([2, 3])
    ReducingConsumer().consume(capture)
    records = [r for r in caplog.records if r.name == LOGGER]
    assert [r.levelno for r in records] == [logging.INFO] * len(SITES)
    for record, site in zip(records, SITES, strict=True):
        message = record.getMessage()
        assert message.startswith(f"request req-1 tag=run/a {site}: [2] norm=")
        assert "| [3] norm=" in message
        assert "omitted" not in message
        norm = capture.tensors[site][0].norm().item()
        assert f"norm={norm:.4g}" in message


def test_level_and_max_positions(caplog):
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    ReducingConsumer(level="debug", max_positions="2").consume(make_capture([0, 1, 2, 3, 4]))
    records = [r for r in caplog.records if r.name == LOGGER]
    assert [r.levelno for r in records] == [logging.DEBUG] * len(SITES)
    message = records[0].getMessage()
    assert "[0] " in message and "[1] " in message and "[2] " not in message
    assert message.endswith("(+3 positions omitted)")


def test_filtered_level_still_returns_stats(caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    result = ReducingConsumer(level="info").consume(make_capture([3]))
    assert not [r for r in caplog.records if r.name == LOGGER]
    assert len(result["stats"]["3.post_block"]["norm"]) == 1


def test_no_positions(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    result = ReducingConsumer().consume(make_capture([]))
    assert result["rows"] == 0
    assert result["stats"]["3.pre_attn"] == {"norm": [], "mean": [], "std": [], "min": [], "max": []}
    assert caplog.records[0].getMessage().endswith("no positions captured")


def test_statistics_travel_packed():
    # One buffer of float32 crosses the process hops, not a Python float per statistic.
    wire = ReducingConsumer().consume_wire(make_capture([1, 2, 3]))
    assert wire["sites"] == SITES
    assert wire["stats"]["shape"] == [len(SITES), 3, len(STATS)] and wire["stats"]["dtype"] == "float32"
    assert isinstance(wire["stats"]["data"], bytes)


def test_pipeline_stages_merge_by_site():
    early, late = SITES[:1], SITES[1:]
    capture = make_capture([2, 3])
    consumer = ReducingConsumer()

    def stage(sites):
        meta = replace(capture.meta, sites=sites)
        return consumer.consume(RequestCapture(meta, {site: capture.tensors[site] for site in sites}))

    whole = consumer.consume(capture)
    assert LoggingConsumer.merge_results([stage(early), stage(late)]) == whole


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"level": "error"}, "level"),
        ({"max_positions": "many"}, "max_positions"),
        ({"max_positions": "0"}, "max_positions"),
        ({"path": "/tmp/x"}, "path"),
    ],
)
def test_bad_engine_options_name_the_option(options, field):
    with pytest.raises(ValueError, match=f"^{field}: "):
        LoggingConsumer.validate_engine_options(options)


def test_request_options_are_the_format_only():
    assert LoggingConsumer.validate_options({}, EngineFacts(8)) == {}
    assert LoggingConsumer.validate_options({"format": "packed"}, EngineFacts(8)) == {"format": "packed"}
    with pytest.raises(ValueError, match="^note: "):
        LoggingConsumer.validate_options({"note": "x"}, EngineFacts(8))
    with pytest.raises(ValueError, match="^format: expected one of lists, packed"):
        LoggingConsumer.validate_options({"format": "csv"}, EngineFacts(8))


def packed_capture(positions: list[int], sites: list[str] = SITES) -> RequestCapture:
    capture = make_capture(positions)
    meta = replace(capture.meta, sites=sites, options={"format": "packed"})
    return RequestCapture(meta, {site: capture.tensors[site] for site in sites})


def test_packed_format_is_the_lists_as_one_tensor():
    consumer = ReducingConsumer()
    lists = consumer.consume(make_capture([1, 2, 3]))
    packed = consumer.consume(packed_capture([1, 2, 3]))
    assert (packed["rows"], packed["sites"], packed["statistics"]) == (lists["rows"], SITES, list(STATS))
    assert packed["stats"].shape == (len(SITES), 3, len(STATS)) and packed["stats"].dtype == torch.float32
    for i, site in enumerate(SITES):
        assert packed["stats"][i].T.tolist() == [lists["stats"][site][key] for key in STATS]


def test_packed_format_over_http_is_base64_of_the_float32_block():
    packed = ReducingConsumer().consume(packed_capture([1, 2]))
    body = json.loads(json.dumps(LoggingConsumer.result_to_json(packed)))
    assert body["stats"]["dtype"] == "float32" and body["stats"]["shape"] == [len(SITES), 2, len(STATS)]
    block = np.frombuffer(base64.b64decode(body["stats"]["data"]), dtype="<f4").reshape(body["stats"]["shape"])
    assert np.array_equal(block, packed["stats"].numpy())
    assert LoggingConsumer.result_to_json({"rows": 0, "stats": {}}) == {"rows": 0, "stats": {}}  # lists as they are


def test_packed_pipeline_stages_merge_by_site():
    consumer = ReducingConsumer()
    whole = consumer.consume(packed_capture([2, 3]))
    merged = LoggingConsumer.merge_results([consumer.consume(packed_capture([2, 3], SITES[:1])),
                                            consumer.consume(packed_capture([2, 3], SITES[1:]))])
    assert merged["sites"] == SITES and merged["rows"] == whole["rows"]
    assert torch.equal(merged["stats"], whole["stats"])
