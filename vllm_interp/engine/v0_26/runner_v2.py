"""The V2 model-runner mixin (``vllm.v1.worker.gpu.model_runner.GPUModelRunner``, vLLM 0.26's default for
dense models on GPUs): where the V2 runner's step reaches the points ``steps.InterpSteps`` acts at.

The V2 runner keeps no per-request sampling params after admitting a request and chooses between CUDA
graphs and eager execution before it lays out the batch, so the mixin reads arrivals from the scheduler's
output and counts a step's read rows (without planning them) before vLLM decides.
Overridden ``GPUModelRunner`` methods (vLLM 0.26; ``TOUCHPOINTS`` below, checked when the worker loads the
model):

- ``execute_model``: before it, new requests are admitted (their specs decoded once, their ``extra_args``
  and prompt length kept: preempted requests come back as new ones) and finished ones finished; a step
  capturing more rows than the graph read buffers hold passes ``is_profile=True``, which in 0.26 does
  nothing but select eager execution; after it, the plan is retired and the step's reads start to copy.
  Consumer threads wait while it runs (``capture.dispatch.FORWARD``). Dummy runs (warm-up, graph capture,
  profiling) are otherwise passed through untouched.
- ``prepare_inputs``: lays out the batch (``InputBatch``); the step is planned and published right after,
  before the forward that ``execute_model`` runs next, and counted as replaying a CUDA graph or not.
"""

from itertools import chain
from typing import Any

from vllm.config import CUDAGraphMode

from vllm_interp.capture.dispatch import FORWARD
from vllm_interp.engine.touchpoints import Touchpoint
from vllm_interp.engine.v0_26.steps import InterpSteps

RUNNER = "vllm.v1.worker.gpu.model_runner:GPUModelRunner"
TOUCHPOINTS = (
    Touchpoint(f"{RUNNER}.execute_model", "override",
               "arrivals and finishes are read first, over-budget capture steps run eagerly, reads are collected",
               params=("scheduler_output", "intermediate_tensors", "dummy_run", "skip_attn_for_dummy_run",
                       "is_profile")),
    Touchpoint(f"{RUNNER}.prepare_inputs", "override", "the step's rows are planned once the batch is laid out",
               params=("scheduler_output", "batch_desc")),
    Touchpoint(f"{RUNNER}.get_model", "call", "the sites are installed on the loaded model's decoder layers"),
    Touchpoint("vllm.v1.worker.gpu.input_batch:InputBatch", "read", "the batch's order and each request's slice",
               params=("req_ids", "query_start_loc_np", "num_computed_tokens_np")),
    Touchpoint("vllm.v1.worker.gpu.cudagraph_utils:BatchExecutionDescriptor", "read",
               "whether the step replays a CUDA graph (checked against its read rows, counted)", params=("cg_mode",)),
    Touchpoint("vllm.config:CUDAGraphMode.NONE", "read", "the mode of a step that runs eagerly"),
    Touchpoint("vllm.v1.core.sched.output:SchedulerOutput", "read", "requests arriving, running and finishing",
               params=("scheduled_new_reqs", "scheduled_cached_reqs", "num_scheduled_tokens",
                       "total_num_scheduled_tokens", "finished_req_ids")),
    Touchpoint("vllm.v1.core.sched.output:NewRequestData", "read", "an arriving request's specs and prompt",
               params=("req_id", "sampling_params", "prompt_token_ids", "num_computed_tokens")),
    Touchpoint("vllm.v1.core.sched.output:CachedRequestData", "read", "where a running request's step starts",
               params=("req_ids", "num_computed_tokens")),
)
ATTRIBUTES = {
    "max_num_tokens": "the height of the site op's row buffers",
    "device": "where the site buffers live",
}


class InterpV2RunnerMixin(InterpSteps):
    # Set by ``attach``: each admitted request's (extra_args, prompt length) until it finishes.
    interp_requests: dict[str, tuple[dict[str, Any] | None, int]]

    def attach(self, *args: Any) -> None:
        super().attach(*args)
        self.interp_requests = {}

    def interp_request(self, req_id: str) -> tuple[dict[str, Any] | None, int]:
        return self.interp_requests[req_id]

    def execute_model(self, scheduler_output, intermediate_tensors=None, dummy_run: bool = False,
                      skip_attn_for_dummy_run: bool = False, is_profile: bool = False):
        with FORWARD.launching():
            if not dummy_run:
                self._interp_arrivals(scheduler_output)
                store, tokens = self.interp_store, scheduler_output.total_num_scheduled_tokens
                # A step reads at most one row per token: one of no more tokens than the graph read buffers hold
                # fits without counting (every decode step of a batch within them), and one of more tokens than
                # any graph runs eagerly anyway (a prefill chunk: counting its reads walked every request).
                if (store.capturing and not store.fits_graph(tokens) and store.may_replay(tokens)
                        and not store.fits_graph(self._interp_count_reads(scheduler_output))):
                    is_profile = True
            try:
                output = super().execute_model(scheduler_output, intermediate_tensors, dummy_run,
                                               skip_attn_for_dummy_run, is_profile)
            finally:
                step = self._interp_retire()
            self._interp_collect(step)
        return output

    def prepare_inputs(self, scheduler_output, batch_desc):
        batch = super().prepare_inputs(scheduler_output, batch_desc)
        self._interp_plan(batch.req_ids, batch.query_start_loc_np, batch.num_computed_tokens_np)
        step, replays = self._interp_step, batch_desc.cg_mode != CUDAGraphMode.NONE
        self.interp_steps_replayed += replays
        if step is not None and replays and not self.interp_store.fits_graph(step.reads.num_rows):
            # The count before vLLM's choice and the plan disagree: the replay would drop rows. Never silently.
            raise RuntimeError(f"vllm-interp planned {step.reads.num_rows} read rows for a step that replays a "
                               f"CUDA graph holding {self.interp_store.bank.graph_read_rows}")
        self._interp_publish()
        return batch

    def _interp_arrivals(self, scheduler_output) -> None:
        for new in scheduler_output.scheduled_new_reqs:
            if new.sampling_params is not None:
                request = (new.sampling_params.extra_args, len(new.prompt_token_ids))
                self.interp_requests[new.req_id] = request
                self._interp_admit(new.req_id, *request)
        for req_id in scheduler_output.finished_req_ids:
            self.interp_requests.pop(req_id, None)
        self._interp_finish(scheduler_output)

    def _interp_count_reads(self, scheduler_output) -> int:
        """The rows this step will read, from the scheduler's output (vLLM's runner has not laid it out yet)."""
        running = scheduler_output.scheduled_cached_reqs
        starts = chain(((new.req_id, new.num_computed_tokens) for new in scheduler_output.scheduled_new_reqs),
                       zip(running.req_ids, running.num_computed_tokens, strict=True))
        scheduled = scheduler_output.num_scheduled_tokens
        return self.interp_store.count_reads((req_id, start, scheduled[req_id]) for req_id, start in starts)
