"""Consumers off the forward path: ConsumerRunner's queue and overload policies, the inline consumer's blob,
stage merging and ``--capture-consumers`` parsing. No engine: captures are built by hand."""

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from vllm_interp.capture.consumer import CaptureConsumer, CaptureMeta, ConsumerContext, PendingCapture, RequestCapture
from vllm_interp.capture.consumers.inline import InlineConsumer, ResidualReadout
from vllm_interp.capture.dispatch import ConsumerRunner, ForwardGate
from vllm_interp.capture.isolation import InThread
from vllm_interp.capture.plugins import DEFAULT_QUEUE_MB, configure_consumers
from vllm_interp.capture.results import ConsumerResult, merge_consumer_results, result_to_json

HIDDEN = 8
POSITIONS = [0, 3, 4]
SITES = ["0.pre_attn", "0.post_block", "1.pre_attn"]
WAIT_S = 5  # generous bound for a thread hand-off; only a broken runner comes close


def make_capture(
    request_id: str,
    sites: list[str] = SITES,
    positions: list[int] = POSITIONS,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> RequestCapture:
    generator = torch.Generator().manual_seed(seed)
    meta = CaptureMeta(
        request_id=request_id,
        tag="run/1",
        model="m",
        prompt_len=4,
        positions=positions,
        sites=sites,
        dtype=str(dtype).removeprefix("torch."),
    )
    tensors = {site: torch.randn(len(positions), HIDDEN, generator=generator).to(dtype) for site in sites}
    return RequestCapture(meta, tensors)


def base_result(capture: RequestCapture) -> ConsumerResult:
    return ConsumerResult(status="ok", rows=len(capture.meta.positions) * len(capture.meta.sites))


def occupy(runner: ConsumerRunner, consumer, capture: RequestCapture) -> Future:
    """Submit ``capture`` and keep the consumer busy with it (gate closed) until the test opens the gate."""
    consumer.gate.clear()
    future = runner.submit(PendingCapture.of(capture), base_result(capture))
    assert consumer.started.wait(WAIT_S)
    return future


def context(name: str = "gated") -> ConsumerContext:
    return ConsumerContext(name=name, options={}, model="m", num_layers=12, hidden_size=HIDDEN)


class GatedConsumer(CaptureConsumer):
    """Records what it consumes; ``consume`` waits for ``gate`` and raises for ids in ``fail_on``."""

    name = "gated"

    def __init__(self, context: ConsumerContext) -> None:
        super().__init__(context)
        self.gate = threading.Event()
        self.gate.set()
        self.started = threading.Event()
        self.fail_on: set[str] = set()
        self.seen: list[RequestCapture] = []
        self.closed = 0

    def consume(self, capture: RequestCapture) -> dict[str, Any]:
        self.started.set()
        if not self.gate.wait(WAIT_S):
            raise TimeoutError("gate never opened")
        self.seen.append(capture)
        if capture.meta.request_id in self.fail_on:
            raise RuntimeError(f"boom on {capture.meta.request_id}")
        return {"request_id": capture.meta.request_id, "sites": list(capture.tensors)}

    def close(self) -> None:
        self.closed += 1


@pytest.fixture
def make_runner(tmp_path: Path) -> Iterator[Any]:
    made: list[ConsumerRunner] = []

    def make(policy: str = "block", queue_bytes: int = 1 << 20, **kwargs: Any) -> tuple[ConsumerRunner, GatedConsumer]:
        consumer = GatedConsumer(context())
        runner = ConsumerRunner(InThread(consumer), policy=policy, queue_bytes=queue_bytes, spill_dir=str(tmp_path),
                                **kwargs)
        made.append(runner)
        return runner, consumer

    yield make
    # A failing test may leave a consumer gated: open it so the runner's thread can finish.
    for runner in made:
        runner.host.consumer.gate.set()
        runner.close()


def one_capture_bytes() -> int:
    return make_capture("x").nbytes


# -- ConsumerRunner ---------------------------------------------------------------------------------------


def test_result_keeps_base_counts_and_adds_payload(make_runner):
    runner, consumer = make_runner()
    capture = make_capture("req-1")
    base = ConsumerResult(status="partial_error", message="positions [5] were not computed", rows=9, dropped=3)
    result = runner.submit(PendingCapture.of(capture), base).result(WAIT_S)
    assert result.status == "partial_error"
    assert result.message == "positions [5] were not computed"
    assert (result.rows, result.dropped, result.spilled) == (9, 3, 0)
    assert result.result == {"request_id": "req-1", "sites": SITES}
    assert [seen.meta for seen in consumer.seen] == [capture.meta]
    assert all(torch.equal(consumer.seen[0].tensors[s], capture.tensors[s]) for s in SITES)


def test_results_resolve_in_submission_order(make_runner):
    runner, consumer = make_runner()
    captures = [make_capture(f"req-{i}", seed=i) for i in range(4)]
    futures = [runner.submit(PendingCapture.of(c), base_result(c)) for c in captures]
    results = [f.result(WAIT_S) for f in futures]
    assert [r.result["request_id"] for r in results] == ["req-0", "req-1", "req-2", "req-3"]
    assert all(r.status == "ok" and r.rows == len(POSITIONS) * len(SITES) for r in results)
    assert [c.meta.request_id for c in consumer.seen] == ["req-0", "req-1", "req-2", "req-3"]


def part_of(request_id: str, part: int, final: bool) -> RequestCapture:
    capture = make_capture(request_id, seed=part)
    return RequestCapture(replace(capture.meta, part=part, final=final), capture.tensors)


def test_a_finished_requests_rows_go_ahead_of_running_requests_parts(make_runner):
    """A request's final part (and its parts still queued, in order) is consumed before running requests'
    parts queued earlier: its stream waits for its results, theirs do not. Whole requests keep their order."""
    runner, consumer = make_runner(queue_bytes=64 << 20)
    busy = occupy(runner, consumer, make_capture("busy"))
    queued = [part_of("running", 0, False), part_of("ending", 0, False), part_of("running", 1, False),
              part_of("whole-1", 0, True), part_of("ending", 1, True), part_of("whole-2", 0, True)]
    futures = [runner.submit(PendingCapture.of(c), base_result(c)) for c in queued]
    consumer.gate.set()
    assert all(f.result(WAIT_S).status == "ok" for f in [busy, *futures])
    assert [(c.meta.request_id, c.meta.part) for c in consumer.seen] == [
        ("busy", 0), ("whole-1", 0), ("ending", 0), ("ending", 1), ("whole-2", 0), ("running", 0), ("running", 1)]


def test_consumer_exception_fails_only_its_request(make_runner):
    runner, consumer = make_runner()
    consumer.fail_on = {"req-2"}
    captures = [make_capture(f"req-{i}") for i in (1, 2, 3)]
    results = [runner.submit(PendingCapture.of(c), base_result(c)).result(WAIT_S) for c in captures]
    assert [r.status for r in results] == ["ok", "error", "ok"]
    failed = results[1]
    assert failed.message == "RuntimeError: boom on req-2"
    assert failed.dropped == len(POSITIONS) * len(SITES)  # nothing of it was stored
    assert failed.result is None
    assert results[2].result["request_id"] == "req-3"


def test_drop_policy(make_runner):
    runner, consumer = make_runner("drop", queue_bytes=one_capture_bytes())
    first, second = make_capture("req-1"), make_capture("req-2")
    first_future = occupy(runner, consumer, first)
    # The consumer still holds the first request: the second does not fit and is refused at once.
    second_future = runner.submit(PendingCapture.of(second), base_result(second))
    assert second_future.done()
    dropped = second_future.result()
    assert dropped.status == "error"
    assert dropped.dropped == len(POSITIONS) * len(SITES)
    assert "overload policy drop" in dropped.message
    assert "gated" in dropped.message and "queue_mb" in dropped.message
    assert not first_future.done()
    consumer.gate.set()
    assert first_future.result(WAIT_S).status == "ok"
    runner.close()
    assert [c.meta.request_id for c in consumer.seen] == ["req-1"]


def test_oversized_request_is_accepted_into_an_empty_queue(make_runner):
    # A request bigger than the whole bound would otherwise never be consumed.
    runner, _ = make_runner("drop", queue_bytes=1)
    capture = make_capture("big")
    assert runner.submit(PendingCapture.of(capture), base_result(capture)).result(WAIT_S).status == "ok"


def test_spill_policy(make_runner, tmp_path):
    runner, consumer = make_runner("spill", queue_bytes=one_capture_bytes())
    captures = [make_capture(f"req-{i}", seed=i) for i in range(3)]
    originals = [{name: t.clone() for name, t in c.tensors.items()} for c in captures]
    futures = [occupy(runner, consumer, captures[0])]
    futures += [runner.submit(PendingCapture.of(c), base_result(c)) for c in captures[1:]]
    # Both requests past the bound wait on disk while the consumer is busy.
    assert len(list(tmp_path.glob("*.safetensors"))) == 2
    assert not any(f.done() for f in futures)
    consumer.gate.set()
    results = [f.result(WAIT_S) for f in futures]
    rows = len(POSITIONS) * len(SITES)
    assert [r.status for r in results] == ["ok", "ok", "ok"]
    assert [r.spilled for r in results] == [0, rows, rows]
    assert [r.rows for r in results] == [rows, rows, rows]
    assert [c.meta.request_id for c in consumer.seen] == ["req-0", "req-1", "req-2"]
    for seen, original in zip(consumer.seen, originals, strict=True):
        assert set(seen.tensors) == set(original)
        for name, tensor in original.items():
            assert torch.equal(seen.tensors[name], tensor)
    assert list(tmp_path.glob("*.safetensors")) == []


def test_spilled_tensors_keep_site_order(make_runner):
    runner, consumer = make_runner("spill", queue_bytes=one_capture_bytes())
    first, second = make_capture("req-1"), make_capture("req-2")
    futures = [occupy(runner, consumer, first)]
    futures.append(runner.submit(PendingCapture.of(second), base_result(second)))
    consumer.gate.set()
    results = [f.result(WAIT_S) for f in futures]
    assert results[1].spilled
    assert results[1].result["sites"] == SITES


def test_block_policy_waits_for_space(make_runner):
    runner, consumer = make_runner("block", queue_bytes=one_capture_bytes())
    first, second = make_capture("req-1"), make_capture("req-2")
    first_future = occupy(runner, consumer, first)
    submitted = threading.Event()
    second_future = []

    def submit_second() -> None:
        second_future.append(runner.submit(PendingCapture.of(second), base_result(second)))
        submitted.set()

    submitter = threading.Thread(target=submit_second, daemon=True)
    submitter.start()
    assert not submitted.wait(0.1), "submit returned while the queue was full"
    consumer.gate.set()
    assert submitted.wait(WAIT_S)
    submitter.join(WAIT_S)
    results = [first_future.result(WAIT_S), second_future[0].result(WAIT_S)]
    assert [r.status for r in results] == ["ok", "ok"]
    assert [r.spilled for r in results] == [0, 0]
    assert [c.meta.request_id for c in consumer.seen] == ["req-1", "req-2"]


def test_block_policy_gives_up_on_a_stalled_consumer(make_runner):
    """A consumer that makes no room in the block timeout fails the waiting request only: the worker goes on."""
    runner, consumer = make_runner("block", queue_bytes=one_capture_bytes(), block_timeout_s=0.2)
    first, second = make_capture("req-1"), make_capture("req-2")
    first_future = occupy(runner, consumer, first)
    started = time.monotonic()
    dropped = runner.submit(PendingCapture.of(second), base_result(second)).result(WAIT_S)
    assert 0.2 <= time.monotonic() - started < WAIT_S
    assert dropped.status == "error" and dropped.dropped == len(POSITIONS) * len(SITES)
    assert "made no room in 0.2 s (stalled?)" in dropped.message
    consumer.gate.set()
    assert first_future.result(WAIT_S).status == "ok"
    third = make_capture("req-3")
    assert runner.submit(PendingCapture.of(third), base_result(third)).result(WAIT_S).status == "ok"


def test_requests_wait_while_the_worker_launches_a_forward(make_runner):
    """A runner takes no request while the forward gate is closed (the worker launching a step, and within it
    the store handing requests on), and takes what queued meanwhile once it opens."""
    gate = ForwardGate()
    runner, consumer = make_runner("block", gate=gate)
    capture = make_capture("req-1")
    with gate.launching():
        with gate.launching():
            future = runner.submit(PendingCapture.of(capture), base_result(capture))
        assert not consumer.started.wait(0.2), "the consumer ran while the worker launched a forward"
    assert future.result(WAIT_S).status == "ok"


def test_a_wave_of_finished_requests_is_handed_on_at_one_opening_of_the_gate(make_runner):
    """Requests that ended together, queued while the worker launched a step, are all handed on once the runner
    is let in, even if the next step's launch closes the gate meanwhile: not one request per opening."""
    gate = ForwardGate()
    runner, consumer = make_runner("block", gate=gate)
    captures = [make_capture(f"req-{i}", seed=i) for i in range(4)]
    consumer.gate.clear()  # the consumer holds the first request until the next launch has begun
    with gate.launching():
        futures = [runner.submit(PendingCapture.of(c), base_result(c)) for c in captures]
    assert consumer.started.wait(WAIT_S)
    with gate.launching():
        consumer.gate.set()
        assert [f.result(WAIT_S).status for f in futures] == ["ok"] * 4
    assert [c.meta.request_id for c in consumer.seen] == [c.meta.request_id for c in captures]


def test_block_policy_opens_the_forward_gate_while_it_waits(make_runner):
    """The worker waiting for room inside a step (the gate closed) lets the runner make that room: the
    request is queued, not dropped as if the consumer had stalled."""
    gate = ForwardGate()
    runner, consumer = make_runner("block", queue_bytes=one_capture_bytes(), block_timeout_s=WAIT_S, gate=gate)
    first, second = make_capture("req-1"), make_capture("req-2")
    with gate.launching():
        first_future = runner.submit(PendingCapture.of(first), base_result(first))
        second_future = runner.submit(PendingCapture.of(second), base_result(second))
        assert not gate._open.is_set()  # closed again once the wait is over
    assert [f.result(WAIT_S).status for f in (first_future, second_future)] == ["ok", "ok"]
    assert [c.meta.request_id for c in consumer.seen] == ["req-1", "req-2"]


def test_close_drains_the_queue_then_closes_the_consumer(make_runner):
    runner, consumer = make_runner()
    consumer.gate.clear()
    captures = [make_capture(f"req-{i}") for i in range(3)]
    futures = [runner.submit(PendingCapture.of(c), base_result(c)) for c in captures]
    closer = threading.Thread(target=runner.close, daemon=True)
    closer.start()
    closer.join(0.1)
    assert closer.is_alive(), "close returned with requests still queued"
    assert consumer.closed == 0
    consumer.gate.set()
    closer.join(WAIT_S)
    assert not closer.is_alive()
    assert all(f.done() for f in futures)
    assert [f.result().status for f in futures] == ["ok", "ok", "ok"]
    assert [c.meta.request_id for c in consumer.seen] == ["req-0", "req-1", "req-2"]
    assert consumer.closed == 1


class ThreadCountConsumer(GatedConsumer):
    """Answers with torch's thread count on the thread that consumes."""

    def consume(self, capture: RequestCapture) -> dict[str, Any]:
        return {"threads": torch.get_num_threads()}


def test_a_runner_copies_on_one_torch_thread_and_leaves_the_engines_count_alone():
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # an engine count the runner's differs from, even on a one-core machine
    try:
        runner = ConsumerRunner(InThread(ThreadCountConsumer(context())), policy="block", queue_bytes=1 << 20)
        capture = make_capture("req-0")
        result = runner.submit(PendingCapture.of(capture), base_result(capture)).result(WAIT_S)
        runner.close()
        later: list[int] = []
        started_later = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
        started_later.start()
        started_later.join(WAIT_S)
        assert result.result == {"threads": 1}
        assert torch.get_num_threads() == 2, "the thread that started the runner lost its count"
        assert later == [2], "a thread started after the runner begins with the runner's count"
    finally:
        torch.set_num_threads(before)


# -- the inline consumer ----------------------------------------------------------------------------------


def inline_consumer() -> InlineConsumer:
    return InlineConsumer(context("inline"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inline_round_trip(dtype):
    sites = ["2.pre_attn", "2.post_block", "10.post_attn"]
    capture = make_capture("req-1", sites=sites, dtype=dtype)
    result = inline_consumer().consume(capture)
    # Offline the tensors come back as they are; over HTTP through a safetensors blob.
    over_http = InlineConsumer.result_to_json(result)
    for readout in (ResidualReadout.from_result(result), ResidualReadout.from_result(over_http)):
        assert readout.positions == POSITIONS
        assert readout.sites == sites  # layer order, not the blob's name order
        assert readout.metadata == capture.meta.to_json()
        for site in sites:
            assert readout[site].dtype == dtype
            assert torch.equal(readout[site], capture.tensors[site])
        assert torch.equal(readout[(10, "post_attn")], capture.tensors["10.post_attn"])
    with pytest.raises(KeyError, match="3.post_block"):
        readout["3.post_block"]


def test_inline_result_to_json():
    capture = make_capture("req-1")
    payload = inline_consumer().consume(capture)
    result = ConsumerResult(status="ok", result=payload, rows=len(POSITIONS) * len(SITES))
    # Over HTTP the blob travels as base64 text inside the JSON body.
    encoded = json.loads(json.dumps(result_to_json(result, InlineConsumer.result_to_json)))
    assert {k: v for k, v in encoded.items() if k != "result"} == result.model_dump(exclude={"result"})
    assert isinstance(encoded["result"]["safetensors"], str)
    readout = ResidualReadout.from_result(encoded["result"])
    direct = ResidualReadout.from_result(payload)
    assert readout.positions == direct.positions == POSITIONS
    assert readout.metadata == direct.metadata
    assert readout.sites == direct.sites == SITES
    for site in SITES:
        assert torch.equal(readout[site], capture.tensors[site])


def stage_results() -> tuple[RequestCapture, RequestCapture, list[dict[str, Any]]]:
    # A pipeline split: stage 0 holds layers 0-2, stage 1 layers 3-11 of the same request.
    early = make_capture("req-1", sites=["0.pre_attn", "0.post_block", "2.post_block"], seed=1)
    late = make_capture("req-1", sites=["3.pre_attn", "10.post_block", "11.pre_attn"], seed=2)
    consumer = inline_consumer()
    # Stages answer in any order.
    return early, late, [consumer.consume(late), consumer.consume(early)]


def test_inline_merge_results():
    early, late, results = stage_results()
    merged = ResidualReadout.from_result(InlineConsumer.merge_results(results))
    expected = ["0.pre_attn", "0.post_block", "2.post_block", "3.pre_attn", "10.post_block", "11.pre_attn"]
    assert merged.sites == expected
    assert merged.metadata["sites"] == expected
    assert merged.positions == POSITIONS
    for capture in (early, late):
        for site, tensor in capture:
            assert torch.equal(merged[site], tensor)
    assert merged.stack("pre_attn").shape == (3, len(POSITIONS), HIDDEN)


def test_inline_merge_results_metadata_layers():
    _, _, results = stage_results()
    merged = ResidualReadout.from_result(InlineConsumer.merge_results(results))
    assert merged.metadata["layers"] == [0, 2, 3, 10, 11]


# -- merge_consumer_results ----------------------------------------------------------------------------------


def test_merge_consumer_results():
    parts = [
        ConsumerResult(status="ok", result={"n": 1}, rows=6),
        ConsumerResult(
            status="partial_error",
            message="positions [7] were not computed",
            result={"n": 2},
            rows=4,
            dropped=2,
            spilled=4,
        ),
        ConsumerResult(status="error", message="RuntimeError: boom", dropped=5),
    ]
    calls = []

    def merge(payloads):
        calls.append(payloads)
        return {"merged": payloads}

    merged = merge_consumer_results(parts, merge)
    assert merged.status == "error"
    assert merged.message == "positions [7] were not computed; RuntimeError: boom"
    assert (merged.rows, merged.dropped, merged.spilled) == (10, 7, 4)
    assert calls == [[{"n": 1}, {"n": 2}]]  # stages without a payload are left out
    assert merged.result == {"merged": [{"n": 1}, {"n": 2}]}


@pytest.mark.parametrize(
    ("statuses", "worst"),
    [(["ok", "ok"], "ok"), (["ok", "partial_error"], "partial_error"), (["error", "partial_error"], "error")],
)
def test_merge_consumer_results_status(statuses, worst):
    parts = [ConsumerResult(status=s) for s in statuses]
    merged = merge_consumer_results(parts, lambda payloads: pytest.fail("no payloads to merge"))
    assert merged.status == worst
    assert merged.message is None
    assert merged.result is None


def test_merge_consumer_results_single_stage_is_unchanged():
    part = ConsumerResult(status="partial_error", message="m", result={"n": 1}, rows=3, dropped=1)
    assert merge_consumer_results([part], lambda payloads: pytest.fail("one stage needs no merge")) is part


# -- configure_consumers ----------------------------------------------------------------------------------


def test_configure_inline():
    setups = configure_consumers(("inline",))
    assert list(setups) == ["inline"]
    setup = setups["inline"]
    assert setup.cls is InlineConsumer
    assert setup.options == {}
    assert setup.queue_bytes == DEFAULT_QUEUE_MB << 20
    assert setup.spill_dir is None


def test_configure_engine_options(tmp_path):
    setups = configure_consumers(("inline:queue_mb=3,spill_dir=" + str(tmp_path), f"filesystem:root={tmp_path}"))
    assert list(setups) == ["inline", "filesystem"]
    assert setups["inline"].queue_bytes == 3 << 20
    assert setups["inline"].spill_dir == str(tmp_path)
    # queue_mb and spill_dir belong to the engine, never to the consumer.
    assert "queue_mb" not in setups["inline"].options
    assert setups["filesystem"].options["root"] == str(tmp_path)


@pytest.mark.parametrize("queue_mb", ["0", "-1", "lots", ""])
def test_configure_bad_queue_mb(queue_mb):
    with pytest.raises(ValueError, match="queue_mb") as info:
        configure_consumers((f"inline:queue_mb={queue_mb}",))
    assert "inline" in str(info.value)


def test_configure_unknown_consumer_lists_installed():
    with pytest.raises(ValueError, match="unknown consumer 'nope'") as info:
        configure_consumers(("nope",))
    assert "filesystem, inline, logging" in str(info.value)


def test_configure_duplicate_refused():
    with pytest.raises(ValueError, match="'inline' is enabled twice"):
        configure_consumers(("inline", "inline:queue_mb=4"))


def test_configure_filesystem_needs_root():
    with pytest.raises(ValueError, match="--capture-consumers filesystem: root: required"):
        configure_consumers(("filesystem",))


def test_configure_unknown_option_names_consumer_and_option():
    with pytest.raises(ValueError, match="--capture-consumers inline: colour: unknown option"):
        configure_consumers(("inline:colour=red",))
