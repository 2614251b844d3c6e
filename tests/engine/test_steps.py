"""What both runner mixins plan around a step (``engine/v0_26/steps.py``), without an engine: a step that no
request of its batch uses a feature in leaves nothing to publish, retire or collect, on an engine with every
feature enabled."""

from types import SimpleNamespace

import numpy as np
import torch

from tests.capture.test_store import HIDDEN, extra_args, make_store
from vllm_interp.capture.consumers.inline import ResidualReadout
from vllm_interp.engine.v0_26.steps import InterpSteps
from vllm_interp.hooks import HOOK_INDEX, site_name
from vllm_interp.models.registry import SiteBank
from vllm_interp.patching.sources import SourceStore
from vllm_interp.patching.tables import PatchTables
from vllm_interp.request_args import EXTRA_ARGS_KEY
from vllm_interp.steering.tables import SteeringTables, table_rows
from vllm_interp.steering.vectors import SteeringVectors


class _Runner(InterpSteps):
    device = torch.device("cpu")

    def __init__(self, requests: dict[str, dict | None]) -> None:
        self.requests = requests

    def interp_request(self, req_id: str) -> tuple[dict | None, int]:
        return self.requests[req_id], 4


def test_a_step_no_request_uses_a_feature_in_plans_nothing_and_one_that_does_plans_its_work():
    steered = SteeringVectors({"base": {site_name(1, "post_block"): np.ones(HIDDEN, np.float32)}})
    requests = {"plain": None,
                "steered": {EXTRA_ARGS_KEY: {"steering": {"vectors": steered.to_wire(), "digest": "s"}}},
                "capturing": extra_args("k", "all")}  # post_block of layer 1
    bank = SiteBank.allocate([0, 1], hidden_size=HIDDEN, dtype=torch.float32, device=torch.device("cpu"),
                             max_tokens=8, steer_rows=table_rows(2), patch_slots=4, graph_read_rows=0)
    store = make_store()
    runner = _Runner(requests)
    runner.attach(store, SteeringTables(bank, 2), PatchTables(bank, SourceStore()))
    try:
        def plan(req_id: str, position: int):  # one decode token
            runner._interp_admit(req_id, requests[req_id], 4)
            runner._interp_plan([req_id], np.array([0, 1]), np.array([position]))
            step = runner._interp_step
            runner._interp_retire()
            return step

        assert plan("plain", 4) is None and plan("plain", 5) is None
        assert plan("steered", 4).steer == {(1, HOOK_INDEX["post_block"])}
        runner._interp_finish(SimpleNamespace(finished_req_ids={"steered"}))  # a SchedulerOutput as read
        assert plan("plain", 6) is None  # the steered request left: nothing to do again
        reads = plan("capturing", 4).site_reads
        assert reads.sites == {(1, HOOK_INDEX["post_block"])} and reads.rows.tolist() == [0]
        assert runner.interp_steps_planned == 5  # every step counts, those that plan nothing too
    finally:
        store.close()


def test_a_step_after_the_last_read_disarms_the_graph_read_buffers_before_steps_plan_nothing():
    requests = {"capturing": extra_args("k", "last_prompt")}
    store = make_store(graph_read_rows=3)  # steps of up to 8 tokens may replay graphs: their reads are armed
    runner = _Runner(requests)
    runner.attach(store, None, None)
    read_slot = store.bank.read_slot
    try:
        runner._interp_admit("capturing", requests["capturing"], 4)
        steps = []
        for position in (3, 4, 5):  # its last prompt token (read), then two decode tokens (nothing to read)
            runner._interp_plan(["capturing"], np.array([0, 1]), np.array([position]))
            steps.append(runner._interp_step)
            runner._interp_retire()
            if position == 3:
                assert read_slot.tolist()[0] == 0  # armed for the replay
        assert steps[0] is not None and steps[1] is None and steps[2] is None
        assert (read_slot == -1).all()  # the step after the read disarmed what the read armed
    finally:
        store.close()


def test_the_steady_decode_steps_of_a_steered_batch_take_the_last_plan_without_planning_it_again():
    steered = SteeringVectors({"decode": {site_name(1, "post_block"): np.ones(HIDDEN, np.float32)}})
    requests = {"plain": None, "capturing": extra_args("k", "all"),
                "steered": {EXTRA_ARGS_KEY: {"steering": {"vectors": steered.to_wire(), "digest": "s"}}}}
    bank = SiteBank.allocate([0, 1], hidden_size=HIDDEN, dtype=torch.float32, device=torch.device("cpu"),
                             max_tokens=8, steer_rows=table_rows(2), patch_slots=4, graph_read_rows=0)
    store = make_store()
    runner, tables = _Runner(requests), SteeringTables(bank, 2)
    runner.attach(store, tables, PatchTables(bank, SourceStore()))
    indexed: list[list[str]] = []
    step_index = tables.step_index
    tables.step_index = lambda layout, request: indexed.append(layout.req_ids) or step_index(layout, request)
    try:
        def plan(req_ids: list[str], tokens: list[int], computed: list[int]):
            for req_id in req_ids:
                runner._interp_admit(req_id, requests[req_id], 4)
            runner._interp_plan(req_ids, np.cumsum([0, *tokens]), np.array(computed))
            return runner._interp_retire()

        sites = {(1, HOOK_INDEX["post_block"])}
        batch = ["steered", "plain"]
        assert plan(batch, [4, 1], [0, 6]).steer == sites  # the steered prompt whole, beside a decode token
        first_decode = plan(batch, [1, 1], [4, 7])  # planned: its tokens moved from prefill rows to decode rows
        assert first_decode.steer == sites and len(indexed) == 2
        decode_row = tables._slots["s"].row("decode")
        assert bank.steer_index[:2].tolist() == [decode_row, 0]
        steady = plan(batch, [1, 1], [5, 8])
        assert steady.steer == sites and steady.reads.num_rows == 0 and steady.site_reads is None
        assert plan(batch, [1, 1], [6, 9]) is steady and len(indexed) == 2  # taken as it was: nothing planned
        assert bank.steer_index[:2].tolist() == [decode_row, 0]
        assert plan(["plain", "steered"], [1, 1], [10, 7]).steer == sites and len(indexed) == 3  # a new order
        assert bank.steer_index[:2].tolist() == [0, decode_row]
        joined = plan(["plain", "steered", "capturing"], [1, 1, 4], [11, 8, 0])  # a capture joins: planned
        assert joined.steer == sites and joined.site_reads.rows.tolist() == [2, 3, 4, 5] and len(indexed) == 4
    finally:
        store.close()


def test_the_steady_decode_steps_of_an_every_token_batch_read_as_planned_in_full_without_laying_it_out():
    steered = SteeringVectors({"decode": {site_name(1, "post_block"): np.ones(HIDDEN, np.float32)}})
    steering = {"steering": {"vectors": steered.to_wire(), "digest": "s"}}
    requests = {"a": extra_args("ka", "all"), "b": extra_args("kb", "all_generated"),
                "c": {EXTRA_ARGS_KEY: {**extra_args("kc", "all")[EXTRA_ARGS_KEY], **steering}}}
    batch = list(requests)

    def run(full: bool) -> tuple[list, list, dict]:
        """Every step's plan, the steps ``plan_reads`` planned, and the results; ``full``: no steady shortcut."""
        bank = SiteBank.allocate([0, 1], hidden_size=HIDDEN, dtype=torch.float32, device=torch.device("cpu"),
                                 max_tokens=16, steer_rows=table_rows(2), patch_slots=1, graph_read_rows=0)
        store, runner = make_store(), _Runner(requests)
        runner.attach(store, SteeringTables(bank, 2), None)
        planned, plan_reads = [], store.plan_reads
        store.plan_reads = lambda layout: planned.append(layout.num_tokens.tolist()) or plan_reads(layout)
        if full:
            store.steady_reads = lambda *args: None
        plans = []
        try:
            for req_id in batch:
                runner._interp_admit(req_id, requests[req_id], 4)
            for tokens, computed in [([4, 4, 4], [0, 0, 0]), *(([1, 1, 1], [n] * 3) for n in range(4, 10))]:
                runner._interp_plan(batch, np.cumsum([0, *tokens]), np.array(computed))
                step = runner._interp_retire()
                plans.append(step)
                # Each row the stream's position plus 100 per request, as the site op hands it back eagerly.
                owner = np.repeat(np.arange(3), tokens)
                values = torch.tensor(np.array(computed)[owner] + np.arange(sum(tokens))
                                      - np.repeat(np.cumsum([0, *tokens[:-1]]), tokens) + 100.0 * owner)
                stream = values[:, None].expand(-1, HIDDEN).float()
                step.site_reads.out.update({site: stream.index_select(0, step.site_reads.rows)
                                            for site in step.site_reads.sites})
                runner._interp_collect(step)
            results = store.results({f"k{req_id}": 11 for req_id in batch}, wait_s=5)
            return plans, planned, results
        finally:
            store.close()

    fast, full = run(full=False), run(full=True)
    assert fast[1] == [[4, 4, 4], [1, 1, 1]] and len(full[1]) == 7  # the prefill step and the batch's first decode
    for taken, planned in zip(fast[0], full[0], strict=True):
        assert taken.steer == planned.steer == {(1, HOOK_INDEX["post_block"])}
        assert taken.reads.req_ids == planned.reads.req_ids
        for field in ("rows", "positions", "slot_starts"):
            np.testing.assert_array_equal(getattr(taken.reads, field), getattr(planned.reads, field))
        assert taken.site_reads.rows.tolist() == planned.site_reads.rows.tolist()
        assert taken.site_reads.sites == planned.site_reads.sites
    for k, req_id in enumerate(batch):
        readouts = [ResidualReadout.from_result(results[f"k{req_id}"]["inline"]["result"])
                    for results in (fast[2], full[2])]
        first = 4 if req_id == "b" else 0
        assert readouts[0].positions == readouts[1].positions == list(range(first, 10))
        expected = torch.arange(first, 10).float() + 100.0 * k
        for readout in readouts:
            torch.testing.assert_close(readout["1.post_block"][:, 0], expected, rtol=0, atol=0)
