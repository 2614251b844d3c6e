"""vLLM 0.26's adapter: every place vllm-interp reaches into vLLM beyond its public extension points.

Each module declares its ``TOUCHPOINTS`` (target, use, one-line reason) and checks them before it hooks
anything; a mismatch stops start-up with ``VllmInternalsMismatch`` naming the internal and the reason.

- ``prefix_cache_keys``: block-hash extra keys (patch); checked when installed, in every process.
- ``scheduler_gate``: the scheduler class vLLM picks (patch), ``schedule``/``add_request``, request queues;
  checked when installed, and a live scheduler's state on its first pass.
- ``runner_v1``, ``runner_v2``: the V1 and V2 ``GPUModelRunner`` step methods (override) and batch state
  (read), for whichever runner vLLM picked (``runner``); checked when a worker loads the model.
- ``worker``, ``cpu_worker``: ``Worker.__init__``/``load_model``/``shutdown`` (override), parallel ranks, the
  speculative config (read); checked when a worker is made.
- ``request_ids``: the engine's request-id format (the caller's id plus a random suffix); same.
- ``openai_params``: the OpenAI request classes' ``to_sampling_params`` (patch), so the HTTP middleware's
  payload reaches ``extra_args`` as is; checked when the endpoint plugin attaches its routes.
- ``serve``: the ``serve`` subcommand, its CLI environment, API-server count, ``VLLM_PLUGINS``, the shutdown
  grace period; checked when ``vllm-interp serve`` starts.
- ``offline``: the offline ``LLM``'s engine core (shutdown) and model config; checked when
  ``vllm_interp.LLM`` starts.
"""

from vllm_interp.engine.touchpoints import Touchpoint

CPU_WORKER = "vllm_interp.engine.v0_26.cpu_worker.InterpCPUWorker"
GPU_WORKER = "vllm_interp.engine.v0_26.worker.InterpGPUWorker"


def install_engine_core_patches() -> None:
    """Intervention-aware block hashes and the admission mixins (no-ops where nothing hashes or schedules)."""
    from vllm_interp.engine.v0_26 import prefix_cache_keys, scheduler_gate

    prefix_cache_keys.install()
    scheduler_gate.install()


def all_touchpoints() -> tuple[Touchpoint, ...]:
    """Every static touchpoint of this adapter (the CPU worker's base class aside: importing it changes
    ``torch.cuda.Event`` process-wide, so it is checked only where it is used)."""
    from vllm_interp.engine.v0_26 import (
        offline,
        openai_params,
        prefix_cache_keys,
        request_ids,
        runner,
        scheduler_gate,
        serve,
        worker,
    )

    return (*prefix_cache_keys.TOUCHPOINTS, *scheduler_gate.TOUCHPOINTS, *runner.all_touchpoints(),
            *worker.TOUCHPOINTS, *request_ids.TOUCHPOINTS, *serve.TOUCHPOINTS, *offline.TOUCHPOINTS,
            *openai_params.TOUCHPOINTS)
