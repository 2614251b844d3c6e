"""The model-runner mixin: plans each step's rows before the forward and collects reads after it.

Installed by the worker as a class swap on vLLM's V1 ``GPUModelRunner`` (which ``CPUModelRunner``
subclasses); mixins cannot rely on ``__init__``, so the worker attaches the read-out store and the steering
tables after the swap.
"""

from functools import cache

from vllm_interp.capture.readout_store import ReadoutStore
from vllm_interp.engine.row_plan import batch_slices, plan_reads
from vllm_interp.models.site_ops import STEP
from vllm_interp.steering.tables import SteeringTables


class InterpRunnerMixin:
    interp_store: ReadoutStore
    interp_steering: SteeringTables | None

    def _model_forward(self, *args, **kwargs):
        # V1 GPUModelRunner._model_forward: called once per real step (never for dummy/profile runs),
        # after _prepare_inputs has laid out the batch (query_start_loc, num_computed_tokens).
        num_reqs = self.input_batch.num_reqs
        req_ids = self.input_batch.req_ids[:num_reqs]
        slices = batch_slices(
            req_ids, self.query_start_loc.np[: num_reqs + 1], self.input_batch.num_computed_tokens_cpu[:num_reqs]
        )
        states = [self.requests[req_id] for req_id in req_ids]
        live = set(req_ids)
        STEP.steer = self._plan_steering(slices, states, live)
        read_plan = self._plan_reads(slices, states, live)
        STEP.read_rows = read_plan.num_rows
        try:
            output = super()._model_forward(*args, **kwargs)
        finally:
            STEP.read_rows, STEP.steer = 0, False
        if read_plan.reads or read_plan.overflow:
            self.interp_store.collect(read_plan)
        return output

    def _plan_steering(self, slices, states, live) -> bool:
        tables = self.interp_steering
        if tables is None:
            return False
        tables.forget_finished(live)
        slots = [tables.lookup(state.req_id, state.sampling_params.extra_args) for state in states]
        index = tables.plan(slices, [state.num_prompt_tokens for state in states], slots)
        tables.load_index(index)
        return index is not None

    def _plan_reads(self, slices, states, live):
        store = self.interp_store
        store.forget_finished(live)
        by_id = {state.req_id: state for state in states}

        def selector(req_id, positions):
            state = by_id[req_id]
            entry = store.lookup(req_id, state.sampling_params.extra_args, state.num_prompt_tokens)
            if entry is None:
                return None
            store.note_progress(req_id, int(positions[-1]) + 1)
            return entry.spec.select(positions, entry.prompt_len)

        plan = plan_reads(slices, selector, store.max_rows)
        store.load_rows(plan)
        return plan


@cache
def with_interp_runner(base: type) -> type:
    return type(f"Interp{base.__name__}", (InterpRunnerMixin, base), {})
