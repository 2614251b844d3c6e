"""What both runner mixins (V1 ``runner_v1.py``, V2 ``runner_v2.py``) do around a step, whichever runner calls it.

A step goes: admit the requests that arrive (each one's capture, patch and steering specs decoded once) and
finish those that end; plan the step's rows from its flattened layout (steering rows, patched rows, read
rows); publish the plan to the site op (``STEP``) for the forward; then retire it, starting the copy of
whatever the sites read. The mixins differ only in which vLLM methods they override to reach these points.
Mixins cannot rely on ``__init__``: the worker attaches the capture store, the steering and patch tables with
``attach`` right after it swaps the runner's class.
"""

from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm_interp.capture.store import CaptureStore
from vllm_interp.engine.v0_26.scheduler_gate import final_lengths
from vllm_interp.models.site_ops import STEP, StepPatches, StepReads
from vllm_interp.patching.tables import PatchTables
from vllm_interp.row_plan import NO_READS, BatchLayout, ReadPlan
from vllm_interp.steering.tables import SteeringTables


@dataclass(frozen=True)
class StepPlan:
    steer: frozenset[tuple[int, int]]  # the (layer, hook index) sites an eager forward adds steering at
    patch: StepPatches | None
    reads: ReadPlan
    site_reads: StepReads | None  # what the site op reads (None: this step reads nothing)


class InterpSteps:
    interp_store: CaptureStore
    interp_steering: SteeringTables | None
    interp_patching: PatchTables | None
    _interp_step: StepPlan | None = None
    _interp_steering_only: StepPlan | None = None
    interp_steps_planned: int = 0  # every step the runner ran (dummy runs aside), for the serving benchmarks
    interp_steps_replayed: int = 0  # of these, the steps whose forward replayed a CUDA graph (the same benchmarks)

    def attach(self, store: CaptureStore, steering: SteeringTables | None, patching: PatchTables | None) -> None:
        self.interp_store, self.interp_steering, self.interp_patching = store, steering, patching
        self._interp_step = None
        self.interp_steps_planned = self.interp_steps_replayed = 0

    def interp_request(self, req_id: str) -> tuple[dict[str, Any] | None, int]:
        """A scheduled request's ``extra_args`` (where its specs travel) and prompt length."""
        raise NotImplementedError

    def _interp_admit(self, req_id: str, extra_args: dict[str, Any] | None, prompt_len: int) -> None:
        # Each request's capture spec is decoded once, when it arrives, so that a step can tell at a glance
        # whether anything in the batch captures; its patch sources are resolved then too.
        self.interp_store.lookup(req_id, extra_args, prompt_len)
        if self.interp_patching is not None:
            self.interp_patching.lookup(req_id, extra_args, prompt_len)

    def _interp_finish(self, scheduler_output: Any) -> None:
        """The scheduler's finished requests (not preempted ones, which come back): captures handed on, cut at
        each request's final length (``scheduler_gate.FinalLengths``)."""
        finished_req_ids = scheduler_output.finished_req_ids
        self.interp_store.finish(finished_req_ids, final_lengths(scheduler_output))
        if self.interp_patching is not None:
            self.interp_patching.finish(finished_req_ids)

    def _interp_plan(self, req_ids: list[str], query_start_loc: np.ndarray, num_computed: np.ndarray) -> None:
        """Plan the step laid out as vLLM's runner laid it out (``num_computed``: per request, in batch order)."""
        self._interp_step = None
        self.interp_steps_planned += 1
        steering, patching, store = self.interp_steering, self.interp_patching, self.interp_store
        total_tokens = int(query_start_loc[len(req_ids)])
        if (patching is None or patching.quiet) and (steering is None or steering.repeats(req_ids, total_tokens)):
            # Nothing patches, and the step steers as the last step of its batch did (every decode step of a
            # steady batch) or not at all: the index buffer holds its map, so only an eager forward needs the
            # sites, to know where to add.
            steer = steering.steered_sites if steering is not None and steering.steers else frozenset()
            if store.quiet:  # nor does anything read
                if steer:
                    self._interp_step = self._steering_only(steer)
                return
            steady = store.steady_reads(req_ids, total_tokens, num_computed, self.device)
            if steady is not None:  # it reads as the last step did, one token further
                self._interp_step = StepPlan(steer, None, *steady)
                return
        layout = BatchLayout.of(req_ids, query_start_loc, num_computed)
        steer = self._plan_steering(layout)
        # Patching and capture act on a few requests of a large batch: only theirs get planned.
        patch = None if patching is None else patching.plan(layout.slices(only=patching.patched_ids))
        reads = self.interp_store.plan_reads(layout)
        site_reads = self.interp_store.site_reads(reads, self.device, layout.total_tokens)
        # A step that steers, patches and reads nothing leaves the site op as ``_interp_retire`` left it (a replayed
        # graph still takes the steering index and read buffers the plan has just written): nothing to publish,
        # retire or collect. Planned read rows keep the plan even where this rank reads none of them: every rank
        # chooses between graphs and eager execution from them alike.
        if steer or patch is not None or reads.num_rows:
            self._interp_step = StepPlan(steer, patch, reads, site_reads)

    def _steering_only(self, sites: frozenset[tuple[int, int]]) -> StepPlan:
        """The plan of a step that only steers, at ``sites``: the last one made while the sites are the same."""
        plan = self._interp_steering_only
        if plan is None or plan.steer is not sites:
            plan = self._interp_steering_only = StepPlan(sites, None, NO_READS, None)
        return plan

    def _plan_steering(self, layout: BatchLayout) -> frozenset[tuple[int, int]]:
        tables = self.interp_steering
        if tables is None:
            return frozenset()
        index = tables.step_index(layout, self.interp_request)
        tables.load_index(index)
        return frozenset() if index is None else tables.steered_sites

    def _interp_publish(self) -> None:
        """Hand the planned step to the site op for the forward that follows."""
        step = self._interp_step
        if step is not None:
            STEP.steer, STEP.patch, STEP.reads = step.steer, step.patch, step.site_reads

    def _interp_retire(self) -> StepPlan | None:
        """After the forward, or its failure: the site op forgets the step; returns it for ``_interp_collect``."""
        step, self._interp_step = self._interp_step, None
        STEP.reads, STEP.steer, STEP.patch = None, frozenset(), None
        return step

    def _interp_collect(self, step: StepPlan | None) -> None:
        """After a forward that ran: start copying what the sites read off the device."""
        if step is not None and step.site_reads is not None:
            self.interp_store.collect(step.reads, step.site_reads)
