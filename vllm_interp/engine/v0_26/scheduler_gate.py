"""Monkeypatch: vllm-interp's admission rules, and what the workers learn of finished requests, in whichever
scheduler vLLM picks.

Wraps ``vllm.config.scheduler.SchedulerConfig.get_scheduler_cls`` (vLLM 0.26), which the engine core calls
once to pick its scheduler class, so that whichever class vLLM picks (``Scheduler``, ``AsyncScheduler`` or
a user's ``--scheduler-cls``) gains the mixins below. ``--scheduler-cls`` itself cannot carry them: they
have to ride on top of the class vLLM would choose, and async scheduling is decided after our flags.

- ``SteeringAdmission``: requests wait for a steering config slot instead of running unsteered. Each worker
  has ``max_steering_configs`` table slots; identical specs share one. Before every scheduling pass the
  gate takes out of the waiting queues the requests whose config is new while all slots are held by
  running requests, and puts them back, in order, afterwards: they are admitted once a slot frees.
- ``CaptureCacheBypass``: a request that captures prompt positions the prefix cache could serve (all but
  the last, which vLLM always computes) skips reading the cache, so that every such row is computed.
- ``FinalLengths``: each finished request's final length (prompt and output tokens) rides to the workers
  beside its id, on the ``SchedulerOutput`` that reports it finished (``final_lengths`` reads it there). An
  async scheduler schedules a request's next step before it knows the request stopped (an EOS, a stop
  token), so one step may run past the end; the worker's capture store drops that step's rows when the
  request finishes, whether or not anyone has asked for its results yet.
"""

import json
from functools import cache
from typing import Any

from vllm_interp.capture.spec import spec_from_wire
from vllm_interp.config import InterpConfig
from vllm_interp.engine.touchpoints import Touchpoint, check_attributes, check_touchpoints
from vllm_interp.request_args import interp_args

_SCHED = "vllm.v1.core.sched.scheduler:Scheduler"
_QUEUE = "vllm.v1.core.sched.request_queue:RequestQueue"
TOUCHPOINTS = (
    Touchpoint("vllm.config.scheduler:SchedulerConfig.get_scheduler_cls", "patch",
               "the engine core picks its scheduler class through it; ours rides on top of vLLM's choice"),
    Touchpoint(f"{_SCHED}.schedule", "override", "requests without a steering slot are held around each pass"),
    Touchpoint(f"{_SCHED}.add_request", "override", "capturing requests skip reading the prefix cache",
               params=("request",)),
    Touchpoint(f"{_QUEUE}.remove_requests", "call", "held requests leave the waiting queues",
               params=("requests",)),
    Touchpoint(f"{_QUEUE}.prepend_request", "call", "held requests return to the queue's front, in order",
               params=("request",)),
    Touchpoint("vllm.v1.request:Request.get_skip_reading_prefix_cache", "read",
               "vLLM's own flag that a request skips prefix-cache reads, set here for capturing requests"),
    Touchpoint(f"{_SCHED}._free_request", "override", "a finished request's final length is noted as it is freed",
               params=("request",)),
    Touchpoint("vllm.v1.request:Request", "read", "a finished request's id", params=("request_id",)),
    Touchpoint("vllm.v1.request:Request.num_tokens", "read", "a finished request's final length"),
    Touchpoint("vllm.v1.core.sched.output:SchedulerOutput", "read",
               "the ids of the requests it reports finished; their final lengths join it",
               params=("finished_req_ids",)),
)
# Where ``FinalLengths`` puts a SchedulerOutput's finished requests' final lengths (req_id -> length).
FINAL_LENGTHS = "interp_final_lengths"
# Scheduler state that exists only on a live scheduler, checked on its first pass.
SCHEDULER_ATTRIBUTES = {
    "running": "digests of running requests hold their steering slots",
    "waiting": "requests waiting for a slot are held here",
    "skipped_waiting": "requests waiting for a slot are held here too",
    "vllm_config": "the steering slot limit and the global capture spec",
}

_installed = False


_NO_DIGEST = ""


def steering_digest(request: Any) -> str | None:
    # Every scheduling pass asks for every running and waiting request: read the spec once per request.
    digest = getattr(request, "interp_steering_digest", None)
    if digest is None:
        params = getattr(request, "sampling_params", None)
        wire = interp_args(params.extra_args if params is not None else None).get("steering")
        digest = request.interp_steering_digest = wire["digest"] if wire else _NO_DIGEST
    return digest or None


class SteeringAdmission:
    _interp_slot_limit: int | None

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        # The engine's config is fixed: read the limit once, not on every scheduling pass.
        if not hasattr(self, "_interp_slot_limit"):
            check_attributes(self, "Scheduler", SCHEDULER_ATTRIBUTES)
            self._interp_slot_limit = _slot_limit(self.vllm_config)
        limit = self._interp_slot_limit
        if limit is None:
            return super().schedule(*args, **kwargs)
        held = self._hold_requests_without_slot(limit)
        try:
            return super().schedule(*args, **kwargs)
        finally:
            for queue, requests in held:
                for request in reversed(requests):
                    queue.prepend_request(request)

    def _hold_requests_without_slot(self, limit: int) -> list[tuple[Any, list[Any]]]:
        # The running requests' slots are gathered only once a waiting request wants one: a pass with nothing
        # steered waiting (every decode step) walks no running request.
        live: set[str] | None = None
        held = []
        for queue in (self.skipped_waiting, self.waiting):
            blocked = []
            for request in queue:
                digest = steering_digest(request)
                if digest is None:
                    continue
                if live is None:
                    live = {d for d in map(steering_digest, self.running) if d is not None}
                if digest in live or len(live) < limit:
                    live.add(digest)
                else:
                    blocked.append(request)
            if blocked:
                queue.remove_requests(blocked)
                held.append((queue, blocked))
        return held


def _slot_limit(vllm_config: Any) -> int | None:
    config = InterpConfig.from_additional_config(vllm_config.additional_config)
    return config.max_steering_configs if config is not None and config.enable_steering else None


class CaptureCacheBypass:
    _interp_global_capture: dict[str, Any]

    def add_request(self, request: Any) -> None:
        if not hasattr(self, "_interp_global_capture"):
            config = InterpConfig.from_additional_config(self.vllm_config.additional_config)
            raw = json.loads(config.capture_global) if config is not None and config.capture_global else {}
            self._interp_global_capture = spec_from_wire(raw)
        params = getattr(request, "sampling_params", None)
        own = interp_args(params.extra_args if params is not None else None).get("capture") or {}
        specs = {**self._interp_global_capture, **spec_from_wire(own)}
        if any(spec.needs_prompt_prefix(request.num_prompt_tokens) for spec in specs.values()):
            request.skip_reading_prefix_cache = True
        super().add_request(request)


class FinalLengths:
    _interp_freed: dict[str, int]

    def _free_request(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        if not hasattr(self, "_interp_freed"):
            self._interp_freed = {}
        self._interp_freed[request.request_id] = request.num_tokens
        return super()._free_request(request, *args, **kwargs)

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        output = super().schedule(*args, **kwargs)
        # Every freed request's id goes out in the next SchedulerOutput's finished ids, and its length with it.
        freed = getattr(self, "_interp_freed", None)
        lengths = {req_id: freed.pop(req_id) for req_id in output.finished_req_ids if req_id in freed} \
            if freed else {}
        setattr(output, FINAL_LENGTHS, lengths)
        return output


def final_lengths(scheduler_output: Any) -> dict[str, int]:
    """The final lengths of the requests ``scheduler_output`` reports finished. Empty for one the scheduler did
    not make (vLLM's empty outputs for dummy steps), which reports none."""
    return getattr(scheduler_output, FINAL_LENGTHS, None) or {}


@cache
def _gated(scheduler_cls: type) -> type:
    return type(f"Interp{scheduler_cls.__name__}", (SteeringAdmission, CaptureCacheBypass, FinalLengths,
                                                     scheduler_cls), {})


def install() -> None:
    global _installed
    if _installed:
        return
    check_touchpoints(TOUCHPOINTS)
    from vllm.config.scheduler import SchedulerConfig

    original = SchedulerConfig.get_scheduler_cls

    def get_scheduler_cls(self):
        return _gated(original(self))

    SchedulerConfig.get_scheduler_cls = get_scheduler_cls
    _installed = True
