"""The model-runner mixin: plans each step's steering and capture rows, and collects captured rows.

Installed by the worker as a class swap on vLLM's V1 ``GPUModelRunner`` (which ``CPUModelRunner``
subclasses); mixins cannot rely on ``__init__``, so the worker attaches the capture store and the steering
tables after the swap. Overridden ``GPUModelRunner`` methods (vLLM 0.26; ``TOUCHPOINTS`` below, checked when
the worker loads the model), in the order a step calls them:

- ``_update_states``: new requests (their capture and patch specs decoded once, patch sources resolved)
  and the scheduler's finished requests, whose captures are handed to consumers;
- ``_prepare_inputs``: lays out the batch (``query_start_loc``, ``num_computed_tokens``); the step is
  planned right after it;
- ``_determine_batch_execution_and_padding``: a step that captures more rows than the graph read buffers
  hold (``--max-graph-capture-rows``) runs without CUDA graphs; others keep them;
- ``_model_forward``: called once per real step (never for dummy or profile runs).
"""

from dataclasses import dataclass
from functools import cache

from vllm_interp.capture.store import CaptureStore
from vllm_interp.engine.touchpoints import Touchpoint
from vllm_interp.models.site_ops import STEP, StepPatches, StepReads
from vllm_interp.patching.tables import PatchTables
from vllm_interp.row_plan import BatchLayout, ReadPlan
from vllm_interp.steering.tables import SteeringTables

_RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
TOUCHPOINTS = (
    Touchpoint(f"{_RUNNER}._update_states", "override", "new requests' specs are decoded, finished captures handed on",
               params=("scheduler_output",)),
    Touchpoint(f"{_RUNNER}._prepare_inputs", "override", "the step's rows are planned once the batch is laid out"),
    Touchpoint(f"{_RUNNER}._determine_batch_execution_and_padding", "override",
               "a step capturing more rows than graphs can read asks for eager execution", params=("force_eager",)),
    Touchpoint(f"{_RUNNER}._model_forward", "override", "the plan is published to the site op around the forward"),
    Touchpoint(f"{_RUNNER}.get_model", "call", "the sites are installed on the loaded model's decoder layers"),
    Touchpoint("vllm.v1.core.sched.output:SchedulerOutput", "read", "requests arriving and finishing this step",
               params=("scheduled_new_reqs", "finished_req_ids")),
    Touchpoint("vllm.v1.worker.gpu_input_batch:CachedRequestState", "read",
               "a request's id and sampling params (where its specs travel)", params=("req_id", "sampling_params")),
)
# Batch state that exists only on a live runner, checked right after the model loads.
RUNNER_ATTRIBUTES = {
    "requests": "each scheduled request's state (sampling params, prompt length)",
    "input_batch.req_ids": "the batch's request order",
    "input_batch.num_reqs": "the batch's size",
    "input_batch.num_computed_tokens_cpu": "where each request's slice starts",
    "query_start_loc.np": "each request's slice of the flattened batch",
    "max_num_tokens": "the height of the site op's row buffers",
    "device": "where the site buffers live",
}


@dataclass(frozen=True)
class _StepPlan:
    steer: bool
    patch: StepPatches | None
    reads: ReadPlan
    site_reads: StepReads | None  # what the site op reads (None: this step reads nothing)


class InterpRunnerMixin:
    interp_store: CaptureStore
    interp_steering: SteeringTables | None
    interp_patching: PatchTables | None
    _interp_step: _StepPlan | None = None

    def _update_states(self, scheduler_output, *args, **kwargs):
        result = super()._update_states(scheduler_output, *args, **kwargs)
        store, patching = self.interp_store, self.interp_patching
        # Each request's capture spec is decoded once, when it arrives, so that a step can tell at a
        # glance whether anything in the batch captures; its patch sources are resolved then too.
        for new in scheduler_output.scheduled_new_reqs:
            state = self.requests.get(new.req_id)
            if state is not None and state.sampling_params is not None:
                store.lookup(new.req_id, state.sampling_params.extra_args, state.num_prompt_tokens)
                if patching is not None:
                    patching.lookup(new.req_id, state.sampling_params.extra_args, state.num_prompt_tokens)
        store.finish(scheduler_output.finished_req_ids)
        if patching is not None:
            patching.finish(scheduler_output.finished_req_ids)
        return result

    def _prepare_inputs(self, *args, **kwargs):
        result = super()._prepare_inputs(*args, **kwargs)
        if self.interp_steering is None and self.interp_patching is None and not self.interp_store.capturing:
            return result  # nothing to plan: the step runs as on an engine without vllm-interp
        num_reqs = self.input_batch.num_reqs
        req_ids = self.input_batch.req_ids[:num_reqs]
        layout = BatchLayout.of(req_ids, self.query_start_loc.np, self.input_batch.num_computed_tokens_cpu)
        steer = self._plan_steering(layout, req_ids)
        patching = self.interp_patching
        # Patching and capture act on a few requests of a large batch: only theirs get planned.
        patch = None if patching is None else patching.plan(layout.slices(only=patching.patched_ids))
        reads = self.interp_store.plan_reads(layout)
        self._interp_step = _StepPlan(steer, patch, reads, self.interp_store.site_reads(reads, self.device))
        return result

    def _determine_batch_execution_and_padding(self, *args, **kwargs):
        step = self._interp_step
        if step is not None and step.reads.num_rows and not self.interp_store.fits_graph(step.reads):
            kwargs["force_eager"] = True
        return super()._determine_batch_execution_and_padding(*args, **kwargs)

    def _model_forward(self, *args, **kwargs):
        step, self._interp_step = self._interp_step, None
        if step is None:
            return super()._model_forward(*args, **kwargs)
        STEP.steer, STEP.patch, STEP.reads = step.steer, step.patch, step.site_reads
        try:
            output = super()._model_forward(*args, **kwargs)
        finally:
            STEP.reads, STEP.steer, STEP.patch = None, False, None
        if step.site_reads is not None:
            self.interp_store.collect(step.reads, step.site_reads)
        return output

    def _plan_steering(self, layout: BatchLayout, req_ids: list[str]) -> bool:
        tables = self.interp_steering
        if tables is None:
            return False
        tables.forget_finished(set(req_ids))
        states = [self.requests[req_id] for req_id in req_ids]
        slots = [tables.lookup(state.req_id, state.sampling_params.extra_args) for state in states]
        index = tables.plan(layout, [state.num_prompt_tokens for state in states], slots)
        tables.load_index(index)
        return index is not None


@cache
def with_interp_runner(base: type) -> type:
    return type(f"Interp{base.__name__}", (InterpRunnerMixin, base), {})
