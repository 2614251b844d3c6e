"""The model-runner mixin: plans each step's rows before the forward and collects reads after it.

Installed by the worker as a class swap on vLLM's V1 ``GPUModelRunner`` (which ``CPUModelRunner``
subclasses); mixins cannot rely on ``__init__``, so the worker attaches ``interp_store`` after the swap.
"""

from functools import cache

from vllm_interp.capture.readout_store import ReadoutStore
from vllm_interp.engine.row_plan import batch_slices, plan_reads
from vllm_interp.models.site_ops import set_step_read_rows


class InterpRunnerMixin:
    interp_store: ReadoutStore

    def _model_forward(self, *args, **kwargs):
        # V1 GPUModelRunner._model_forward: called once per real step (never for dummy/profile runs),
        # after _prepare_inputs has laid out the batch (query_start_loc, num_computed_tokens).
        store = self.interp_store
        num_reqs = self.input_batch.num_reqs
        req_ids = self.input_batch.req_ids[:num_reqs]
        slices = batch_slices(
            req_ids, self.query_start_loc.np[: num_reqs + 1], self.input_batch.num_computed_tokens_cpu[:num_reqs]
        )
        store.forget_finished(set(req_ids))

        def selector(req_id, positions):
            state = self.requests[req_id]
            entry = store.lookup(req_id, state.sampling_params.extra_args, state.num_prompt_tokens)
            if entry is None:
                return None
            store.note_progress(req_id, int(positions[-1]) + 1)
            return entry.spec.select(positions, entry.prompt_len)

        plan = plan_reads(slices, selector, store.max_rows)
        store.load_rows(plan)
        set_step_read_rows(plan.num_rows)
        try:
            output = super()._model_forward(*args, **kwargs)
        finally:
            set_step_read_rows(0)
        if plan.reads or plan.overflow:
            store.collect(plan)
        return output


@cache
def with_interp_runner(base: type) -> type:
    return type(f"Interp{base.__name__}", (InterpRunnerMixin, base), {})
