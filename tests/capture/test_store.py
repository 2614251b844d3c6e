"""The worker-side capture store without an engine: rows by position, finalizing, results."""

from collections import deque

import numpy as np
import pytest
import torch

from vllm_interp.capture import host_copies
from vllm_interp.capture import store as store_module
from vllm_interp.capture.consumer import ConsumerContext, EngineFacts, RowReduction
from vllm_interp.capture.consumers.inline import InlineConsumer, ResidualReadout
from vllm_interp.capture.consumers.logging import STATS, LoggingConsumer, row_statistics
from vllm_interp.capture.dispatch import ConsumerRunner
from vllm_interp.capture.isolation import InThread
from vllm_interp.capture.spec import spec_to_wire, validate_capture_spec
from vllm_interp.capture.store import CaptureStore
from vllm_interp.models.registry import SiteBank
from vllm_interp.request_args import EXTRA_ARGS_KEY
from vllm_interp.row_plan import BatchLayout

LAYERS, HIDDEN = 2, 4


class InlineInParts(InlineConsumer):
    """``inline`` taking a request in parts of two positions at one site (HIDDEN float32 values each)."""

    @classmethod
    def part_bytes(cls, options: dict) -> int:
        return 2 * HIDDEN * 4

    def consume(self, capture):
        return {**super().consume(capture), "part": capture.meta.part, "final": capture.meta.final}

    @classmethod
    def merge_parts(cls, results: list[dict]) -> dict:
        return {"parts": results}


@pytest.fixture(autouse=True, params=["small_blocks_whole", "every_block_split"])
def block_landing(request, monkeypatch) -> str:
    """Every test both ways: these blocks are small, so they land whole (views per request), as on an engine;
    and as large blocks land (``host_copies.to_host``): split per request, or held where they landed when their
    readers all take parts or all end with the step."""
    if request.param == "every_block_split":
        monkeypatch.setattr(host_copies, "WHOLE_MAX_BYTES", -1)
    return request.param


def make_store(consumers: tuple[str, ...] = ("inline",), graph_read_rows: int = 0,
               consumer_class: type[InlineConsumer] = InlineConsumer) -> CaptureStore:
    """``consumers=()``: a tensor-parallel rank other than 0, which runs no inline consumer;
    ``graph_read_rows``: the graph read buffers' rows (0: graphs never read), for steps of up to 8 tokens."""
    max_tokens = 8
    bank = SiteBank(layers=[0, 1], steer_index=torch.zeros(max_tokens, dtype=torch.long),
                    steer_table=torch.zeros(LAYERS, 3, 1, HIDDEN),
                    patch_index=torch.zeros(LAYERS, 3, 1, dtype=torch.long), patch_values=torch.zeros(1, HIDDEN),
                    patch_alpha=torch.zeros(1), read_slot=torch.full((max_tokens if graph_read_rows else 1,), -1),
                    read_flags=torch.zeros(LAYERS, 3, dtype=torch.int32),
                    read_out=torch.zeros(LAYERS, 3, graph_read_rows, HIDDEN))
    context = ConsumerContext("inline", {}, "m", num_layers=LAYERS, hidden_size=HIDDEN)
    runner = ConsumerRunner(InThread(consumer_class(context)), policy="block", queue_bytes=1 << 20)
    return CaptureStore(bank, num_layers=LAYERS, model="m", consumers={name: runner for name in consumers},
                        global_spec={}, external_id=str, max_graph_tokens=max_tokens if graph_read_rows else 0)


def extra_args(key: str, positions) -> dict:
    spec = validate_capture_spec({"inline": {"hooks": {"post_block": [1]}, "positions": positions}},
                                 engine=EngineFacts(LAYERS), consumers={"inline": InlineConsumer})
    return {EXTRA_ARGS_KEY: {"capture": spec_to_wire(spec), "capture_key": key}}


def step(store: CaptureStore, req_id: str, start: int, tokens: int, stream: torch.Tensor) -> None:
    """One step of one request computing positions start..start+tokens; ``stream`` is [tokens, hidden]."""
    plan = store.plan_reads(BatchLayout.of([req_id], np.array([0, tokens]), np.array([start])))
    reads = store.site_reads(plan, torch.device("cpu"), 0)
    if reads is None:
        return
    reads.out[(1, 2)] = stream.index_select(0, reads.rows)  # what the site op at 1.post_block would hand back
    store.collect(plan, reads)


def test_each_row_reduction_runs_once_when_the_store_is_made(monkeypatch):
    """A reduction's first call may build a kernel (Triton on a GPU): the store makes that call at start-up, on
    a row of the model's width and dtype, not in the first step that captures."""
    calls = []
    recording = RowReduction("recorded", 1, lambda rows: calls.append((rows.shape, rows.dtype)) or rows[..., :1])
    monkeypatch.setattr(InlineConsumer, "row_reduction", recording)
    store = make_store(consumers=("inline",))
    assert calls == [(torch.Size([1, HIDDEN]), torch.float32)]
    store.close()


def test_a_step_arms_the_graph_read_buffers_and_clears_what_the_last_one_set():
    """Before a step that may replay a graph, each planned row's token row points at its read slot and the wanted
    sites' flags are set; the next step's rows replace the last's (which go back to -1); a step reading more rows
    than the buffers hold, or nothing, leaves every row unread."""
    store = make_store(graph_read_rows=3)
    bank = store.bank
    store.lookup("a", extra_args("a", "all"), prompt_len=2)
    store.lookup("b", extra_args("b", "all"), prompt_len=2)

    def arm(ids: list[str], tokens: list[int]) -> None:
        layout = BatchLayout.of(ids, np.array([0, *np.cumsum(tokens)]), np.zeros(len(ids), dtype=np.int64))
        store.site_reads(store.plan_reads(layout), torch.device("cpu"), sum(tokens))

    arm(["a", "b"], [2, 1])  # token rows 0, 1 (a) and 2 (b)
    assert bank.read_slot.tolist() == [0, 1, 2, -1, -1, -1, -1, -1]
    assert bank.read_flags.tolist() == [[0, 0, 0], [0, 0, 1]]  # 1.post_block only
    arm(["b", "a"], [1, 1])
    assert bank.read_slot.tolist() == [0, 1, -1, -1, -1, -1, -1, -1]
    arm(["a", "b"], [2, 2])  # four rows: past the buffers, this step runs eagerly
    assert bank.read_slot.tolist() == [-1] * 8 and bank.read_flags.tolist() == [[0, 0, 0], [0, 0, 0]]
    # A steady batch plans the same rows step after step: uploaded once, armed until a step reads otherwise.
    arm(["b", "a"], [1, 1])
    armed = store._armed_rows
    arm(["b", "a"], [1, 1])
    assert store._armed_rows is armed and bank.read_slot.tolist() == [0, 1, -1, -1, -1, -1, -1, -1]
    arm(["a", "b"], [2, 2])
    arm(["b", "a"], [1, 1])  # the same rows as two steps ago, after a step that cleared them
    assert bank.read_slot.tolist() == [0, 1, -1, -1, -1, -1, -1, -1]
    store.close()


EVERY_SITE = tuple((layer, hook) for layer in (0, 1) for hook in range(3))


@pytest.mark.parametrize("sites", [((0, 2), (1, 2)), ((1, 1),), EVERY_SITE, ((0, 0), (1, 2)), ((0, 1), (0, 2))])
def test_a_replayed_steps_rows_come_from_the_graph_read_buffers_at_their_sites(sites):
    """One hook of consecutive layers and every hook of them are views of the buffers, other sets gathered:
    each the ``[sites, rows, hidden]`` block of those sites, in their order."""
    store = make_store(graph_read_rows=3)
    out = store.bank.read_out
    out.copy_(torch.arange(out.numel(), dtype=out.dtype).reshape(out.shape))
    expected = torch.stack([out[layer, hook, :2] for layer, hook in sites])
    assert torch.equal(store._graph_block(sites, 2), expected)
    assert torch.equal(store._graph_block(sites, 2), expected)  # the reader is kept for the next step
    store.close()


def test_rows_by_position_across_chunks_and_a_recompute():
    store = make_store()
    store.lookup("r", extra_args("k", "all"), prompt_len=5)
    first = torch.randn(4, HIDDEN)
    step(store, "r", 0, 4, first)
    step(store, "r", 0, 4, first + 1)  # preempted and recomputed: the latest rows win, no duplicates
    tail = torch.randn(3, HIDDEN)
    step(store, "r", 4, 3, tail)
    result = store.results({"k": 8}, wait_s=5)["k"]["inline"]
    assert result["status"] == "ok" and result["rows"] == 7
    readout = ResidualReadout.from_result(result["result"])
    assert readout.positions == list(range(7))
    torch.testing.assert_close(readout["1.post_block"], torch.cat([first + 1, tail]), rtol=0, atol=0)
    assert not store.capturing
    store.close()


@pytest.mark.parametrize("laid", [[[3, 4], [5], [6, 7, 8]], [[3, 4], [4, 5]], [[3, 4], [6]], [[5], [3, 4]],
                                  [[3, 5], [4, 6]]],
                         ids=["consecutive", "recomputed", "a_gap", "out_of_order", "spanning_out_of_order"])
def test_columns_of_consecutive_chunks_are_found_as_the_general_layout_finds_them(laid):
    """The arithmetic layout of consecutive positions answers as the sorted one, and only they get it."""
    from types import SimpleNamespace

    from vllm_interp.row_plan import ReadPlan

    def chunk(positions):
        plan = ReadPlan(rows=np.zeros(len(positions), np.int64), positions=np.array(positions, np.int64),
                        req_ids=["r"], slot_starts=np.array([0, len(positions)]))
        return SimpleNamespace(plan=plan), 0, None

    chunks = [chunk(positions) for positions in laid]
    columns = store_module._Columns.of(chunks)
    flat = np.concatenate([np.array(p) for p in laid])
    assert (columns.column is None) == (laid == [[3, 4], [5], [6, 7, 8]])
    positions, from_end = np.unique(flat[::-1], return_index=True)
    general = store_module._Columns(positions, len(flat) - 1 - from_end, len(flat))
    wanted = np.arange(0, 12)
    np.testing.assert_array_equal(columns.held(wanted), general.held(wanted))
    held = wanted[general.held(wanted)]
    np.testing.assert_array_equal(columns.columns_of(held), general.columns_of(held))
    for picked in (general.columns_of(held), general.columns_of(held)[1:]):
        assert columns.every_column(picked) == general.every_column(picked)


def test_a_request_whose_consumer_takes_parts_is_handed_on_while_it_runs():
    """Each time a running request's filed rows reach the part size, every landed step but the newest goes to
    the consumer; the newest waits for the next part (it may run past the request's end). A position handed on
    is not handed on again when a preempted request computes it anew; the last part comes at the end, and the
    request's result merges its parts'."""
    store = make_store(consumer_class=InlineInParts)
    store.lookup("r", extra_args("k", "all"), prompt_len=3)
    streams = [torch.randn(n, HIDDEN) for n in (3, 1, 1)]
    # A step is filed when the next one is collected (its copy has landed by then).
    step(store, "r", 0, 3, streams[0])
    step(store, "r", 3, 1, streams[1])  # files positions 0-2: one step landed, nothing handed on yet
    step(store, "r", 4, 1, streams[2])  # files 3: part 0, positions 0-2
    recomputed = torch.randn(5, HIDDEN)
    step(store, "r", 0, 5, recomputed)  # preempted and recomputed; files 4: part 1, position 3
    tail = torch.randn(2, HIDDEN)
    step(store, "r", 5, 1, tail[:1])  # files the recompute: part 2, position 4 (the first copy)
    step(store, "r", 6, 1, tail[1:])  # files 5: the recompute's positions were all handed on, no part
    assert [len(f) for f in store._entries["r"].parts.values()] == [3]
    result = store.results({"k": 8}, wait_s=5)["k"]["inline"]
    assert result["status"] == "ok" and result["rows"] == 7
    parts = result["result"]["parts"]
    assert [(p["part"], p["final"]) for p in parts] == [(0, False), (1, False), (2, False), (3, True)]
    readouts = [ResidualReadout.from_result(p) for p in parts]
    assert [r.positions for r in readouts] == [[0, 1, 2], [3], [4], [5, 6]]
    rows = torch.cat([r["1.post_block"] for r in readouts])
    torch.testing.assert_close(rows, torch.cat([*streams, tail]), rtol=0, atol=0)
    store.close()


class InlineInLongParts(InlineInParts):
    @classmethod
    def part_bytes(cls, options: dict) -> int:
        return 16 * HIDDEN * 4


def test_the_parts_of_requests_decoding_together_are_spread_over_the_steps():
    """Requests decoding together reach the part size in the same step. Their first parts come together; each
    later part of a request is cut a different fraction of a part later than the others', so the batch's
    parts come spread over the steps (not 4 in one step, then none for 15) and every position goes out once."""
    store = make_store(consumer_class=InlineInLongParts)
    ids, steps = [f"r{i}" for i in range(4)], 70
    for req_id in ids:
        store.lookup(req_id, extra_args(req_id, "all"), prompt_len=1)
    cut_at: dict[str, list[int]] = {req_id: [] for req_id in ids}
    for position in range(steps):
        plan = store.plan_reads(BatchLayout.of(ids, np.arange(len(ids) + 1), np.full(len(ids), position)))
        reads = store.site_reads(plan, torch.device("cpu"), len(ids))
        reads.out[(1, 2)] = torch.full((len(ids), HIDDEN), float(position)).index_select(0, reads.rows)
        store.collect(plan, reads)
        for req_id in ids:
            if len(store._entries[req_id].parts.get("inline", [])) > len(cut_at[req_id]):
                cut_at[req_id].append(position)
    assert len({cuts[0] for cuts in cut_at.values()}) == 1  # the first parts: together
    later = [cut for cuts in cut_at.values() for cut in cuts[1:]]
    assert len(later) >= 8 and len(set(later)) == len(later)  # the others: never two in one step
    results = store.results({req_id: steps + 1 for req_id in ids}, wait_s=5)
    for req_id in ids:
        readouts = [ResidualReadout.from_result(p) for p in results[req_id]["inline"]["result"]["parts"]]
        assert sum((r.positions for r in readouts), []) == list(range(steps))
        rows = torch.cat([r["1.post_block"] for r in readouts])
        assert torch.equal(rows[:, 0], torch.arange(steps, dtype=rows.dtype))
    store.close()


def test_a_block_whose_readers_all_take_parts_is_read_where_it_landed(block_landing, monkeypatch):
    """Its readers let go of it within about a part, so it is not split per request; one large enough for the
    pinned arena (whose ring waits for its oldest region) is held for the readers whose rows in it fill a
    part, and the others get their own copies when it lands (a request decoding in a prefill step); it is
    split when no reader fills a part, as in a steady batch's decode step."""
    store = make_store(consumer_class=InlineInLongParts)
    store.lookup("short", extra_args("short", "all"), prompt_len=3)
    store.lookup("long", extra_args("long", "all"), prompt_len=16)

    def landing(req_ids: list[str], tokens: list[int], starts: tuple[int, ...] = (0, 0)) -> str:
        layout = BatchLayout.of(req_ids, np.array([0, *np.cumsum(tokens)]), np.array(starts[: len(req_ids)]))
        plan = store.plan_reads(layout)
        reads = store.site_reads(plan, torch.device("cpu"), sum(tokens))
        reads.out[(1, 2)] = torch.randn(sum(tokens), HIDDEN).index_select(0, reads.rows)
        store.collect(plan, reads)
        copy = store._pending[-1].rows
        return "split" if isinstance(copy, host_copies.SplitCopy) else "held" if copy.keep_pinned else "whole"

    small = block_landing == "small_blocks_whole"  # these blocks then land whole, as views
    assert landing(["short", "long"], [3, 16]) == ("whole" if small else "held")
    monkeypatch.setattr(host_copies, "PINNED_CACHED_MAX_BYTES", 0)  # every block takes the arena
    assert landing(["long"], [16]) == ("whole" if small else "held")  # 16 rows: a whole part
    assert landing(["short", "long"], [3, 16]) == ("whole" if small else "held")  # "short": 3 rows of 16
    held = store._pending[-1]
    store._drain()
    short_step, _, own = store._entries["short"].chunks[-1]
    long_step, _, _ = store._entries["long"].chunks[-1]
    assert long_step is held
    if not small:  # "short"'s rows are its own: its chunk keeps nothing of the held block
        assert short_step is not held and short_step.rows is None
        assert torch.equal(own[None], held.rows.part(0))
        assert not np.shares_memory(own[None].numpy(), held.rows.part(0).numpy())
    for start in range(3):  # decode steps, the later ones a steady batch's: a row each, never a part
        assert landing(["short", "long"], [1, 1], (3 + start, 16 + start)) == ("whole" if small else "split")
    assert store.read_steps["steady"] > 0
    store.close()


def test_held_memory_let_go_of_is_given_back_when_results_are_polled(monkeypatch):
    """Held pinned memory whose last view went on a consumer's thread waits for the forward thread; an engine
    that runs no more steps after a burst still gives it back, when the API server polls for results."""
    store = make_store()
    released = []
    monkeypatch.setattr(host_copies, "_DROPPED", deque([(torch.empty(4), lambda: released.append(True))]))
    store.results({"nosuch": 3}, wait_s=0)
    assert released == [True] and not host_copies._DROPPED
    store.close()


def test_steps_without_wanted_positions_read_nothing_and_unknown_keys_answer_empty():
    store = make_store()
    store.lookup("r", extra_args("k", "last_prompt"), prompt_len=3)
    assert store.capturing
    step(store, "r", 0, 2, torch.randn(2, HIDDEN))  # positions 0-1: nothing wanted
    assert store.site_reads(store.plan_reads(BatchLayout.of([], np.array([0]), np.array([]))),
                            torch.device("cpu"), 0) is None
    step(store, "r", 2, 1, torch.randn(1, HIDDEN))
    assert store.results({"nosuch": 3}, wait_s=0) == {"nosuch": {}}
    assert store.results({"k": 4}, wait_s=5)["k"]["inline"]["rows"] == 1
    store.close()


def test_asks_for_results_are_counted_with_the_time_spent_answering_them():
    store = make_store()
    for _ in range(2):
        store.results({"nosuch": 3}, wait_s=0)
    assert store.results_asks["asks"] == 2 and store.results_asks["seconds"] > 0
    store.close()


def test_results_nobody_claims_are_bounded(monkeypatch):
    monkeypatch.setattr(store_module, "MAX_UNCLAIMED_RESULTS", 2)
    store = make_store()
    for i in range(4):
        store.lookup(f"r{i}", extra_args(f"k{i}", "last_prompt"), prompt_len=1)
        step(store, f"r{i}", 0, 1, torch.randn(1, HIDDEN))
    store.finish({f"r{i}" for i in range(4)})
    answered = store.results({f"k{i}": 2 for i in range(4)}, wait_s=5)
    # Two were dropped (their consumers still ran); the two finalized last are there.
    assert sorted(str(a.get("inline", {}).get("status")) for a in answered.values()) == ["None", "None", "ok", "ok"]
    store.close()


def test_ranks_without_the_consumer_plan_the_same_rows_and_read_none():
    """Every tensor-parallel rank must agree on whether a step reads (a reading step runs eagerly): a rank
    that runs no consumer of the request plans the same rows as rank 0, reads nothing and answers empty."""
    rank0, rank1 = make_store(), make_store(consumers=())
    plans = []
    for store in (rank0, rank1):
        store.lookup("r", extra_args("k", "all"), prompt_len=5)
        plans.append(store.plan_reads(BatchLayout.of(["r"], np.array([0, 4]), np.array([0]))))
    assert plans[0].num_rows == plans[1].num_rows == 4
    np.testing.assert_array_equal(plans[0].rows, plans[1].rows)
    assert rank0.site_reads(plans[0], torch.device("cpu"), 0) is not None
    assert rank1.site_reads(plans[1], torch.device("cpu"), 0) is None
    assert rank1.capturing
    assert rank1.results({"k": 5}, wait_s=0) == {"k": {}}
    rank0.close()
    rank1.close()


def test_requests_whose_positions_are_all_computed_leave_the_planning_set():
    store = make_store()
    store.lookup("prompt", extra_args("a", "last_prompt"), prompt_len=3)
    store.lookup("open", extra_args("b", "all"), prompt_len=3)
    store.lookup("listed", extra_args("c", [1, 6]), prompt_len=3)
    step(store, "prompt", 0, 3, torch.randn(3, HIDDEN))
    step(store, "open", 0, 3, torch.randn(3, HIDDEN))
    step(store, "listed", 0, 3, torch.randn(3, HIDDEN))
    # Steps plan reads for these alone: the prompt capture is done, the others may still read.
    assert store.reading_ids == {"open", "listed"}
    step(store, "listed", 3, 4, torch.randn(4, HIDDEN))
    assert store.reading_ids == {"open"}
    assert store.capturing  # two still hold rows for their consumers (the prompt capture went to its consumer)
    result = store.results({"a": 4}, wait_s=5)["a"]["inline"]
    assert result["status"] == "ok" and result["rows"] == 1
    store.close()


def test_a_prompt_capture_goes_to_its_consumer_when_its_last_rows_land(block_landing):
    """A request that read its last prompt rows ends with that step: its consumer has it before the request
    finishes generating, and a step whose readers all end lands whole (no copy per request)."""
    store = make_store()
    store.lookup("a", extra_args("a", "last_prompt"), prompt_len=3)
    store.lookup("b", extra_args("b", "last_prompt"), prompt_len=2)
    stream = torch.randn(5, HIDDEN)
    plan = store.plan_reads(BatchLayout.of(["a", "b"], np.array([0, 3, 5]), np.array([0, 0])))
    reads = store.site_reads(plan, torch.device("cpu"), 0)
    reads.out[(1, 2)] = stream.index_select(0, reads.rows)
    store.collect(plan, reads)
    assert not store.capturing  # both ended: no step plans reads any more
    (landed,) = store._pending
    assert isinstance(landed.rows, host_copies.WholeCopy)
    # Neither finished (no ``finish``, no final length): asking without waiting finds both handed on.
    results = store.results({"a": 9, "b": 9}, wait_s=5)
    rows = {key: ResidualReadout.from_result(results[key]["inline"]["result"]) for key in ("a", "b")}
    assert rows["a"].positions == [2] and rows["b"].positions == [1]
    torch.testing.assert_close(rows["a"]["1.post_block"], stream[2:3], rtol=0, atol=0)
    torch.testing.assert_close(rows["b"]["1.post_block"], stream[4:5], rtol=0, atol=0)
    store.finish({"a", "b"})  # the scheduler's finish later finds nothing left to do
    assert store.results({"a": 9}, wait_s=0) == {"a": {}}
    # A large step that an open-ended reader shares lands split, so that the reader keeps no other's rows alive
    # (a small one lands whole: a reader keeps at most WHOLE_MAX_BYTES of them).
    store.lookup("c", extra_args("c", "last_prompt"), prompt_len=1)
    store.lookup("d", extra_args("d", "all"), prompt_len=1)
    plan = store.plan_reads(BatchLayout.of(["c", "d"], np.array([0, 1, 2]), np.array([0, 0])))
    reads = store.site_reads(plan, torch.device("cpu"), 0)
    reads.out[(1, 2)] = stream[:2]
    store.collect(plan, reads)
    split = block_landing == "every_block_split"
    assert isinstance(store._pending[-1].rows, host_copies.SplitCopy if split else host_copies.WholeCopy)
    assert store.reading_ids == {"d"}
    store.close()


def test_requests_of_one_step_wanting_different_sites_get_their_own_rows(block_landing):
    """A step's block holds the union of its requests' sites; each request's rows are picked out of it (off
    the forward path, when its consumer runs), across steps whose site sets differ."""
    store = make_store()
    spec = {"inline": {"hooks": {"pre_attn": [0], "post_block": [1]}, "positions": "all"}}
    wide = validate_capture_spec(spec, engine=EngineFacts(LAYERS), consumers={"inline": InlineConsumer})
    store.lookup("wide", {EXTRA_ARGS_KEY: {"capture": spec_to_wire(wide), "capture_key": "w"}}, prompt_len=2)
    store.lookup("narrow", extra_args("n", "all"), prompt_len=2)
    streams = {site: torch.randn(2, 3, HIDDEN) for site in [(0, 0), (1, 2)]}  # [step, rows, hidden] per site
    for step_index, ids in enumerate([["wide", "narrow"], ["narrow"]]):
        starts = np.array([0, *np.cumsum([1] * len(ids))])
        plan = store.plan_reads(BatchLayout.of(ids, starts, np.array([step_index] * len(ids))))
        reads = store.site_reads(plan, torch.device("cpu"), 0)
        for site in reads.sites:
            reads.out[site] = streams[site][step_index].index_select(0, reads.rows)
        store.collect(plan, reads)
    store._drain()
    (wide_step, _, wide_own), (narrow_step, _, narrow_own) = (store._entries[r].chunks[0] for r in ("wide", "narrow"))
    assert wide_step is narrow_step
    if block_landing == "every_block_split":
        # Each request holds its own copy of a shared step's rows, and the step none: a long request keeps no
        # other's rows alive.
        assert wide_step.rows is None
        assert wide_own[None].untyped_storage().data_ptr() != narrow_own[None].untyped_storage().data_ptr()
    else:  # a small block stays whole with the step, and each request reads its view of it (the first step is
        # one of a steady batch, which the second ended: filed as that batch's steps, stacked)
        assert isinstance(wide_step.rows, host_copies.SteppedCopy) and wide_own is None and narrow_own is None
    store.finish({"wide", "narrow"})
    wide_rows = ResidualReadout.from_result(store.results({"w": 1}, wait_s=5)["w"]["inline"]["result"])
    narrow_rows = ResidualReadout.from_result(store.results({"n": 2}, wait_s=5)["n"]["inline"]["result"])
    assert wide_rows.positions == [0] and narrow_rows.positions == [0, 1]
    torch.testing.assert_close(wide_rows["0.pre_attn"], streams[(0, 0)][0, :1], rtol=0, atol=0)
    torch.testing.assert_close(wide_rows["1.post_block"], streams[(1, 2)][0, :1], rtol=0, atol=0)
    expected = torch.stack([streams[(1, 2)][0, 1], streams[(1, 2)][1, 0]])
    torch.testing.assert_close(narrow_rows["1.post_block"], expected, rtol=0, atol=0)
    store.close()


def test_open_ended_position_specs_plan_from_their_first_position_as_their_masks_would():
    """Every-token specs (``all``, ``all_generated``, and unions that leave no gap) are planned from their first
    position without a mask; the rows are those the specs' masks pick, over a prefill chunk and decode steps."""
    engine, consumers = EngineFacts(LAYERS), {"inline": InlineConsumer, "logging": LoggingConsumer}

    def lookup(store, req_id, positions):
        spec = validate_capture_spec({name: {"hooks": {"post_block": [1]}, "positions": p}
                                      for name, p in zip(consumers, positions, strict=False)},
                                     engine=engine, consumers=consumers)
        return store.lookup(req_id, {EXTRA_ARGS_KEY: {"capture": spec_to_wire(spec)}}, prompt_len=4)

    store = make_store()
    cases = [(("all",), 0), (("all_generated",), 4), (("all_generated", "last_prompt"), 3),
             (("all_prompt", "all_generated"), 0), (("all_prompt",), None), (("all_generated", [1]), None)]
    for i, (positions, first) in enumerate(cases):
        entry = lookup(store, f"r{i}", positions)
        assert entry.reads_from == first, positions
        for start, count in [(0, 3), (3, 2), (5, 1)]:  # a prompt chunk, the prompt's end and a decode token
            # The V2 runner counts a step's rows before it lays the batch out: the count is the plan's.
            counted = store.count_reads([(f"r{i}", start, count)])
            plan = store.plan_reads(BatchLayout.of([f"r{i}"], np.array([0, count]), np.array([start])))
            assert counted == plan.num_rows, (positions, start)
            expected = np.arange(start, start + count)[entry.select(np.arange(start, start + count))]
            assert [plan.positions_of(k).tolist() for k in range(len(plan.req_ids))] == (
                [expected.tolist()] if len(expected) else [])
            assert plan.rows.tolist() == (expected - start).tolist()
    store.close()


def test_a_steady_decode_batch_is_planned_and_filed_as_the_loop_over_its_requests_does_it(monkeypatch):
    """Decode steps of an unchanged batch of every-token requests reuse the last step's plan (no loop over the
    requests) and are kept for the batch until it changes; each plan equals the one planned request by request,
    through joins, a preemption's reordering, a prefill chunk, a bounded spec, a finished request and one ended
    by its caller, and keeps its positions when the runner rewrites its buffers; every request's rows come out
    as when each step is planned and filed request by request."""
    planned, plan_by_loop = [], store_module.plan_reads
    monkeypatch.setattr(store_module, "plan_reads", lambda *args: planned.append(1) or plan_by_loop(*args))
    fast, reference = make_store(), make_store()
    steps = [  # (requests joining, the batch as (req_id, position start, tokens), whether the last plan is reused)
        ({"a": "all", "b": "all_generated"}, [("a", 0, 4), ("b", 0, 4)], False),
        ({}, [("a", 4, 1), ("b", 4, 1)], False),  # after a prefill
        ({}, [("a", 5, 1), ("b", 5, 1)], True),
        ({}, [("a", 6, 1), ("b", 6, 1)], True),
        ({"c": "all"}, [("a", 7, 1), ("b", 7, 1), ("c", 0, 3)], False),  # a join, with a prefill chunk
        ({}, [("a", 8, 1), ("b", 8, 1), ("c", 3, 1)], False),
        ({}, [("a", 9, 1), ("b", 9, 1), ("c", 4, 1)], True),
        ({}, [("b", 10, 1), ("a", 10, 1), ("c", 5, 1)], False),  # reordered (a preemption and a resume)
        ({}, [("b", 11, 1), ("a", 11, 1), ("c", 6, 1)], True),
        ({"d": [2, 3]}, [("b", 12, 1), ("a", 12, 1), ("c", 7, 1), ("d", 0, 4)], False),  # a bounded spec
        ({}, [("b", 13, 1), ("a", 13, 1), ("c", 8, 1)], False),
        ({}, [("b", 14, 1), ("a", 14, 1), ("c", 9, 1)], True),
        ("finish c", [("b", 15, 1), ("a", 15, 1)], False),
        ({}, [("b", 16, 1), ("a", 16, 1)], True),
        ("end a", [("b", 17, 1), ("a", 17, 1)], False),  # its caller took its results: a reads no more
        ({}, [("b", 18, 1), ("a", 18, 1)], False),
        ({}, [("b", 19, 1)], False),
        ({}, [("b", 20, 1)], True),
    ]
    taken = {"fast": {}, "reference": {}}
    for joining, batch, reused in steps:
        for name, store in (("fast", fast), ("reference", reference)):
            if joining == "finish c":
                store.finish({"c"})
            elif joining == "end a":
                taken[name].update(store.results({"a": 18}, wait_s=5.0))
            for req_id, positions in (joining if isinstance(joining, dict) else {}).items():
                store.lookup(req_id, extra_args(req_id, positions), prompt_len=4)
        req_ids = [req_id for req_id, _, _ in batch]
        starts = np.cumsum([0] + [tokens for _, _, tokens in batch])
        computed = np.array([start for _, start, _ in batch])
        # Each row of the step's stream holds its request and position.
        stream = torch.tensor([[ord(req_id) * 100.0 + start + i] * HIDDEN
                               for req_id, start, tokens in batch for i in range(tokens)])
        planned.clear()
        plan = fast.plan_reads(BatchLayout.of(req_ids, starts, computed))
        assert (not planned) == reused, batch
        expected = reference.plan_reads(BatchLayout.of(req_ids, starts, computed))
        reference._drop_steady()  # the reference plans and files every step request by request
        computed += 100  # the runner rewrites its buffers for the next step
        assert (plan.rows.tolist(), plan.positions.tolist(), plan.req_ids, plan.slot_starts.tolist()) == (
            expected.rows.tolist(), expected.positions.tolist(), expected.req_ids, expected.slot_starts.tolist())
        for store, step_plan in ((fast, plan), (reference, expected)):
            reads = store.site_reads(step_plan, torch.device("cpu"), 0)
            if reads is not None:
                reads.out[(1, 2)] = stream.index_select(0, reads.rows)
                store.collect(step_plan, reads)
    for name, store in (("fast", fast), ("reference", reference)):
        taken[name].update(store.results({"b": 22, "c": 100, "d": 100}, wait_s=5.0))
    def readout(result: dict) -> tuple:
        rows = ResidualReadout.from_result(result["inline"]["result"])
        return result["inline"]["status"], rows.positions, rows.tensors["1.post_block"][:, 0].tolist()

    rows = {name: {key: readout(result) for key, result in results.items()} for name, results in taken.items()}
    assert rows["fast"] == rows["reference"]
    assert reference.read_steps["steady"] == 0 < fast.read_steps["steady"]
    assert rows["fast"]["b"] == ("ok", list(range(4, 21)), [ord("b") * 100.0 + p for p in range(4, 21)])
    assert rows["fast"]["a"][1] == list(range(17))  # the length its caller gave: positions before 17
    fast.close()
    reference.close()


def test_a_request_ending_in_a_steady_batch_waits_for_the_steps_still_in_flight(monkeypatch):
    """A steady batch notes its requests' last steps when it is settled: a request that ends while the copies of
    its steady steps are still in flight is finalized once they have landed, with every row."""
    store = make_store()
    for req_id in ("a", "b"):
        store.lookup(req_id, extra_args(req_id, "all"), prompt_len=2)
    in_flight = [False]
    landed = store_module._StepRows.done
    monkeypatch.setattr(store_module._StepRows, "done", lambda self: not in_flight[0] and landed(self))
    for position in range(8):
        if position == 4:
            in_flight[0] = True  # the steady steps' copies from here on have not landed
        layout = BatchLayout.of(["a", "b"], np.array([0, 1, 2]), np.array([position, position]))
        plan = store.plan_reads(layout)
        reads = store.site_reads(plan, torch.device("cpu"), 0)
        reads.out[(1, 2)] = torch.full((2, HIDDEN), float(position))
        store.collect(plan, reads)
    assert store.results({"a": 9}, wait_s=0.0) == {}  # ended; its last steps have not landed
    in_flight[0] = False
    result = store.results({"a": 9}, wait_s=5.0)["a"]["inline"]
    rows = ResidualReadout.from_result(result["result"])
    assert (result["status"], rows.positions) == ("ok", list(range(8)))
    assert rows.tensors["1.post_block"][:, 0].tolist() == [float(p) for p in range(8)]
    store.close()


@pytest.mark.parametrize("in_place", [True, False], ids=["reduced_in_place", "reduced_then_copied"])
def test_a_steady_batchs_summaries_are_reduced_into_blocks_of_steps_with_the_rows_of_step_by_step(monkeypatch,
                                                                                                   in_place):
    """Every-token capture to a consumer that takes row summaries (``logging``): a steady batch's steps are
    reduced into blocks of ``ReducedSteps.STEPS`` steps, each copied off as one, the last partial block when
    the batch changes or a caller waits for a request mid-block; every request's statistics equal those of its
    steps filed one by one, and those of its rows. A reduction that cannot write in place is copied in."""
    monkeypatch.setattr(host_copies.ReducedSteps, "STEPS", 4)
    if not in_place:
        monkeypatch.setattr(LoggingConsumer, "row_reduction", RowReduction("statistics", len(STATS), row_statistics))
    sent, send = [], host_copies._StepsBlock.send

    def counted(block: host_copies._StepsBlock) -> None:
        if block.copy is None:
            sent.append(block.count)
        send(block)

    monkeypatch.setattr(host_copies._StepsBlock, "send", counted)

    def logging_store() -> CaptureStore:
        bank = make_store().bank
        context = ConsumerContext("logging", LoggingConsumer.validate_engine_options({}), "m", num_layers=LAYERS,
                                  hidden_size=HIDDEN)
        runner = ConsumerRunner(InThread(LoggingConsumer(context)), policy="block", queue_bytes=1 << 20)
        return CaptureStore(bank, num_layers=LAYERS, model="m", consumers={"logging": runner}, global_spec={},
                            external_id=str, max_graph_tokens=0)

    spec = validate_capture_spec({"logging": {"hooks": {"post_block": [0, 1]}, "positions": "all"}},
                                 engine=EngineFacts(LAYERS), consumers={"logging": LoggingConsumer})
    fast, reference = logging_store(), logging_store()
    streams: dict[tuple[str, int], torch.Tensor] = {}  # each (request, position)'s rows at the two sites

    def run(store: CaptureStore, batch: list[tuple[str, int, int]], by_loop: bool) -> None:
        req_ids = [req_id for req_id, _, _ in batch]
        layout = BatchLayout.of(req_ids, np.cumsum([0] + [n for _, _, n in batch]), np.array([s for _, s, _ in batch]))
        plan = store.plan_reads(layout)
        if by_loop:
            store._drop_steady()
        reads = store.site_reads(plan, torch.device("cpu"), 0)
        rows = [(r, s + i) for r, s, n in batch for i in range(n)]
        for req_id, position in rows:
            streams.setdefault((req_id, position), torch.randn(2, HIDDEN))
        for layer in (0, 1):
            stream = torch.stack([streams[row][layer] for row in rows])
            reads.out[(layer, 2)] = stream.index_select(0, reads.rows)
        store.collect(plan, reads)

    results = {}
    for name, store in (("fast", fast), ("reference", reference)):
        for req_id in "ab":
            store.lookup(req_id, {EXTRA_ARGS_KEY: {"capture": spec_to_wire(spec), "capture_key": req_id}}, 3)
        run(store, [("a", 0, 3), ("b", 0, 3)], name == "reference")
        for position in range(3, 13):  # ten decode steps of a steady batch: blocks of 4, 4, then 2 ...
            run(store, [("a", position, 1), ("b", position, 1)], name == "reference")
        if name == "fast":
            assert sent == [4, 4]
        results.update({(name, k): v for k, v in store.results({"a": 14}, wait_s=5.0).items()})  # ... sent now
        for position in range(13, 20):  # b alone: a new steady batch
            run(store, [("b", position, 1)], name == "reference")
        results.update({(name, k): v for k, v in store.results({"b": 21}, wait_s=5.0).items()})
    assert sent == [4, 4, 2, 4, 3]  # b's last partial block sent when its caller waits
    assert reference.read_steps["steady"] == 0 < fast.read_steps["steady"]
    for req_id, length in (("a", 13), ("b", 20)):
        fast_result, reference_result = results[("fast", req_id)], results[("reference", req_id)]
        assert fast_result == reference_result
        stats = LoggingConsumer.result_from_wire(fast_result["logging"]["result"])["stats"]
        for layer in (0, 1):
            rows = torch.stack([streams[(req_id, position)][layer] for position in range(length)])
            torch.testing.assert_close(torch.tensor(stats[f"{layer}.post_block"]["norm"]), rows.norm(dim=-1))
            torch.testing.assert_close(torch.tensor(stats[f"{layer}.post_block"]["max"]), rows.amax(dim=-1))
    fast.close()
    reference.close()


def test_requests_ending_together_are_all_handed_on_before_a_runner_starts_on_them(monkeypatch):
    """Finalizing keeps the forward gate closed: a runner gathering one request's rows beside the thread that
    finalizes the next would have both wait on the interpreter lock."""
    gate_open_while_finalizing = []
    finalize = CaptureStore._finalize

    def watched(self, entry, length):
        gate_open_while_finalizing.append(store_module.FORWARD._open.is_set())
        finalize(self, entry, length)

    monkeypatch.setattr(CaptureStore, "_finalize", watched)
    store = make_store()
    stream = torch.arange(6 * HIDDEN, dtype=torch.float32).reshape(6, HIDDEN)
    for req_id in ("a", "b", "c"):
        store.lookup(req_id, extra_args(req_id, "all"), prompt_len=4)
        step(store, req_id, 0, 4, stream[:4])
    results = store.results({"a": 5, "b": 5, "c": 5}, wait_s=5.0)
    assert gate_open_while_finalizing == [False, False, False]
    assert store_module.FORWARD._open.is_set()
    assert {key: result["inline"]["status"] for key, result in results.items()} == dict.fromkeys("abc", "ok")
    store.close()


def test_an_early_ask_ends_nothing_and_takes_results_that_are_whole():
    """A results ask without a length (a stream's, at its first event) leaves a running request running: an
    every-token capture answers nothing yet and goes on capturing; a ``last_prompt`` one, ended with the step
    that read its last prompt row, is answered."""
    store = make_store()
    store.lookup("all", extra_args("k-all", "all"), prompt_len=3)
    store.lookup("last", extra_args("k-last", "last_prompt"), prompt_len=3)
    for req_id in ("all", "last"):
        step(store, req_id, 0, 3, torch.randn(3, HIDDEN))
    answered = {}
    for _ in range(50):  # the consumer's thread answers within moments
        answered.update(store.results({"k-all": None, "k-last": None}, wait_s=0.1))
        if "k-last" in answered:
            break
    assert set(answered) == {"k-last"} and answered["k-last"]["inline"]["rows"] == 1
    step(store, "all", 3, 1, torch.randn(1, HIDDEN))  # still capturing
    assert store.results({"k-all": 5}, wait_s=5)["k-all"]["inline"]["rows"] == 4
    store.close()


def test_a_request_the_scheduler_finishes_keeps_no_rows_past_its_final_length():
    """An async scheduler runs a request's next step before it knows the request stopped: that step's rows are
    past the end. With the final length the scheduler reports beside the finish (``FinalLengths``), the store
    drops them even when the finish comes before anyone asks for the results; without one it keeps every row."""
    store = make_store()
    for req_id in ("known", "unknown"):
        store.lookup(req_id, extra_args(f"k-{req_id}", "all"), prompt_len=3)
    streams = {req_id: torch.randn(6, HIDDEN) for req_id in ("known", "unknown")}
    for req_id, stream in streams.items():
        step(store, req_id, 0, 3, stream[:3])
        for position in (3, 4, 5):  # two generated tokens fed back, then the step that ran past the stop
            step(store, req_id, position, 1, stream[position : position + 1])
    # Three tokens generated (the third a stop): final length 6, so positions 0-4 were fed to the model.
    store.finish({"known", "unknown"}, {"known": 6})
    results = store.results({"k-known": None, "k-unknown": None}, wait_s=5)
    rows = {req_id: ResidualReadout.from_result(results[f"k-{req_id}"]["inline"]["result"]) for req_id in streams}
    assert rows["known"].positions == [0, 1, 2, 3, 4] and rows["unknown"].positions == [0, 1, 2, 3, 4, 5]
    torch.testing.assert_close(rows["known"]["1.post_block"], streams["known"][:5], rtol=0, atol=0)
    assert store.ends == {"finished_with_length": 1, "positions_past_end": 1}
    store.close()
