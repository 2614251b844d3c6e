"""The V1 model-runner mixin (``vllm.v1.worker.gpu_model_runner.GPUModelRunner``, which vLLM's CPU runner
subclasses): where the V1 runner's step reaches the points ``steps.InterpSteps`` acts at.

Overridden ``GPUModelRunner`` methods (vLLM 0.26; ``TOUCHPOINTS`` below, checked when the worker loads the
model), in the order a step calls them:

- ``_update_states``: new requests are admitted (their specs decoded once) and the scheduler's finished
  requests finished, whose captures are handed to consumers;
- ``_prepare_inputs``: lays out the batch (``query_start_loc``, ``num_computed_tokens``); the step is
  planned right after it;
- ``_determine_batch_execution_and_padding``: a step that captures more rows than the graph read buffers
  hold (``--max-graph-capture-rows``) runs without CUDA graphs; others keep them;
- ``_model_forward``: called once per real step (never for dummy or profile runs): the plan is published
  around it, consumer threads wait while it runs (``capture.dispatch.FORWARD``), and the step is counted as
  replaying a CUDA graph or not (the forward context's mode).
"""

from typing import Any

from vllm.config import CUDAGraphMode
from vllm.forward_context import get_forward_context

from vllm_interp.capture.dispatch import FORWARD
from vllm_interp.engine.touchpoints import Touchpoint
from vllm_interp.engine.v0_26.steps import InterpSteps

RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
TOUCHPOINTS = (
    Touchpoint(f"{RUNNER}._update_states", "override", "new requests' specs are decoded, finished captures handed on",
               params=("scheduler_output",)),
    Touchpoint(f"{RUNNER}._prepare_inputs", "override", "the step's rows are planned once the batch is laid out"),
    Touchpoint(f"{RUNNER}._determine_batch_execution_and_padding", "override",
               "a step capturing more rows than graphs can read asks for eager execution", params=("force_eager",)),
    Touchpoint(f"{RUNNER}._model_forward", "override", "the plan is published to the site op around the forward"),
    Touchpoint("vllm.forward_context:get_forward_context", "call", "the mode a real step's forward runs in"),
    Touchpoint("vllm.forward_context:ForwardContext", "read", "whether the step replays a CUDA graph (counted)",
               params=("cudagraph_runtime_mode",)),
    Touchpoint("vllm.config:CUDAGraphMode.NONE", "read", "the mode of a step that runs eagerly"),
    Touchpoint(f"{RUNNER}.get_model", "call", "the sites are installed on the loaded model's decoder layers"),
    Touchpoint("vllm.v1.core.sched.output:SchedulerOutput", "read", "requests arriving and finishing this step",
               params=("scheduled_new_reqs", "finished_req_ids")),
    Touchpoint("vllm.v1.worker.gpu_input_batch:CachedRequestState", "read",
               "a request's id and sampling params (where its specs travel)", params=("req_id", "sampling_params")),
)
# Batch state that exists only on a live runner, checked right after the model loads.
ATTRIBUTES = {
    "requests": "each scheduled request's state (sampling params, prompt length)",
    "input_batch.req_ids": "the batch's request order",
    "input_batch.num_reqs": "the batch's size",
    "input_batch.num_computed_tokens_cpu": "where each request's slice starts",
    "query_start_loc.np": "each request's slice of the flattened batch",
    "max_num_tokens": "the height of the site op's row buffers",
    "device": "where the site buffers live",
}


class InterpV1RunnerMixin(InterpSteps):
    def interp_request(self, req_id: str) -> tuple[dict[str, Any] | None, int]:
        state = self.requests[req_id]
        return state.sampling_params.extra_args, state.num_prompt_tokens

    def _update_states(self, scheduler_output, *args, **kwargs):
        result = super()._update_states(scheduler_output, *args, **kwargs)
        for new in scheduler_output.scheduled_new_reqs:
            state = self.requests.get(new.req_id)
            if state is not None and state.sampling_params is not None:
                self._interp_admit(new.req_id, state.sampling_params.extra_args, state.num_prompt_tokens)
        self._interp_finish(scheduler_output)
        return result

    def _prepare_inputs(self, *args, **kwargs):
        result = super()._prepare_inputs(*args, **kwargs)
        batch = self.input_batch
        self._interp_plan(batch.req_ids[: batch.num_reqs], self.query_start_loc.np, batch.num_computed_tokens_cpu)
        return result

    def _determine_batch_execution_and_padding(self, *args, **kwargs):
        step = self._interp_step
        if step is not None and not self.interp_store.fits_graph(step.reads.num_rows):
            kwargs["force_eager"] = True
        return super()._determine_batch_execution_and_padding(*args, **kwargs)

    def _model_forward(self, *args, **kwargs):
        self.interp_steps_replayed += get_forward_context().cudagraph_runtime_mode != CUDAGraphMode.NONE
        with FORWARD.launching():
            if self._interp_step is None:
                return super()._model_forward(*args, **kwargs)
            self._interp_publish()
            try:
                output = super()._model_forward(*args, **kwargs)
            finally:
                step = self._interp_retire()
            self._interp_collect(step)
            return output
