"""The worker mixin, and vLLM's GPU worker with it: the hook sites, installed right after the model loads.

``load_model`` runs before the profile run (the first Dynamo trace) and before CUDA-graph capture, so
every compiled graph contains the sites. The runner's class is swapped for one with the mixin for the runner
vLLM picked (V1 or V2, ``runner.py``); the capture store (with its consumers), the steering and patch tables
are attached to it. The worker's touchpoints are checked against the installed vLLM when it is made, the
runner's before the model loads. An engine configured with what capture cannot serve (speculative decoding) is
refused when its worker is made, before it sets up devices.

Overridden ``Worker`` methods (vLLM 0.26; ``TOUCHPOINTS``): ``__init__`` (the checks above), ``load_model``
(the sites, after the weights), ``shutdown`` (consumers drain first).
"""

import json
import sys
from typing import Any

import torch
from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank
from vllm.model_executor.models.utils import PPMissingLayer
from vllm.v1.worker.gpu_worker import Worker

from vllm_interp.capture.consumer import ConsumerContext, EngineFacts
from vllm_interp.capture.dispatch import ConsumerRunner
from vllm_interp.capture.isolation import consumer_host
from vllm_interp.capture.plugins import configure_consumers
from vllm_interp.capture.spec import validate_capture_spec
from vllm_interp.capture.store import CaptureStore
from vllm_interp.config import InterpConfig
from vllm_interp.engine.gc_clock import start_gc_clock
from vllm_interp.engine.touchpoints import Touchpoint, check_touchpoints
from vllm_interp.engine.v0_26 import request_ids
from vllm_interp.engine.v0_26.runner import hooks_for
from vllm_interp.engine.versions import check_vllm_version
from vllm_interp.models.registry import install_sites
from vllm_interp.patching.sources import SOURCES
from vllm_interp.patching.tables import PATCH_RESULT, PatchTables
from vllm_interp.sae import load_saes
from vllm_interp.steering.tables import SteeringTables, table_rows
from vllm_interp.steering.vectors import SteeringVectors

TOUCHPOINTS = (
    Touchpoint("vllm.v1.worker.gpu_worker:Worker.__init__", "override",
               "an engine feature capture cannot serve is refused before the worker starts", params=("vllm_config",)),
    Touchpoint("vllm.config:VllmConfig", "read", "capture is refused where draft tokens are verified",
               params=("speculative_config",)),
    Touchpoint("vllm.v1.worker.gpu_worker:Worker.load_model", "override",
               "the sites go in after the weights load, before the profile run traces the model"),
    Touchpoint("vllm.v1.worker.gpu_worker:Worker.shutdown", "override", "consumers drain before the process exits"),
    Touchpoint("vllm.distributed:get_pp_group", "call", "a pipeline stage reports its own layers"),
    Touchpoint("vllm.config:CompilationConfig", "read", "steps of more tokens than any CUDA graph never replay one",
               params=("max_cudagraph_capture_size",)),
    Touchpoint("vllm.distributed:get_tensor_model_parallel_rank", "call", "tensor-parallel rank 0 alone consumes rows"),
    Touchpoint("vllm.model_executor.models.utils:PPMissingLayer", "read", "layers another stage holds get no sites"),
)


def apply_switch_interval(config: InterpConfig) -> None:
    """``--engine-switch-interval-ms`` in this worker's process (0 leaves Python's own)."""
    if config.engine_switch_interval_ms:
        sys.setswitchinterval(config.engine_switch_interval_ms / 1000)


def refuse_speculative_capture(config: InterpConfig, speculative_config: Any) -> None:
    """Speculative decoding verifies draft tokens in one step: the step computes a row for each draft, rejected
    ones included, and a request's last step computes rows past its end. Capture (and patching, whose sources
    are captures) would return those rows as the request's, so it is refused; steering only adds to rows,
    which the verify step steers as any other, by position."""
    if speculative_config is not None and config.consumers:
        raise ValueError(
            "vllm-interp capture and patching do not run with speculative decoding: its verify steps compute rows "
            "for draft tokens that may be rejected. Start the engine without a speculative config, or without "
            f"capture consumers and patching (enabled here: {', '.join(config.consumer_names)}); steering runs "
            "with speculative decoding.")


class InterpWorkerMixin:
    def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        # Before the worker sets up devices and distributed state: a refused engine leaves nothing behind.
        check_vllm_version()
        check_touchpoints((*TOUCHPOINTS, *request_ids.TOUCHPOINTS))
        config = InterpConfig.from_additional_config(vllm_config.additional_config) or InterpConfig()
        refuse_speculative_capture(config, vllm_config.speculative_config)
        super().__init__(vllm_config, *args, **kwargs)
        self.interp_config = config

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        runner_hooks = hooks_for(self.model_runner)  # built by init_device, before the model loads
        check_touchpoints(runner_hooks.touchpoints)
        super().load_model(*args, **kwargs)
        config = self.interp_config
        apply_switch_interval(config)
        self.interp_gc_clock = start_gc_clock()
        runner = self.model_runner
        model_config = self.vllm_config.model_config
        steer_rows = table_rows(config.max_steering_configs) if config.enable_steering else 1
        max_graph_tokens = self.vllm_config.compilation_config.max_cudagraph_capture_size or 0
        bank = install_sites(
            runner.get_model(),
            hidden_size=model_config.get_hidden_size(),
            dtype=model_config.dtype,
            device=runner.device,
            max_tokens=runner.max_num_tokens,
            steer_rows=steer_rows,
            patch_slots=config.max_patch_rows + 1 if config.enable_patching else 1,
            # Only CUDA graphs read from these buffers.
            graph_read_rows=config.graph_read_rows(max_graph_tokens) if runner.device.type == "cuda" else 0,
            is_held=lambda layer: not isinstance(layer, PPMissingLayer),
        )
        runner_hooks.install(runner)
        self.interp_runner = runner_hooks.name
        patching = None
        if config.enable_patching:
            SOURCES.budget_bytes = config.patch_source_bytes
            patching = PatchTables(bank, SOURCES)
        runner.attach(self._capture_store(config, bank, max_graph_tokens),
                      SteeringTables(bank, config.max_steering_configs) if config.enable_steering else None, patching)

    def _capture_store(self, config: InterpConfig, bank, max_graph_tokens: int) -> CaptureStore:
        model_config = self.vllm_config.model_config
        num_layers = model_config.get_total_num_hidden_layers()
        saes = load_saes(config.saes, num_layers=num_layers, hidden_size=model_config.get_hidden_size())
        setups = configure_consumers(config.consumers)
        global_spec = {}
        if config.capture_global:
            global_spec = validate_capture_spec(json.loads(config.capture_global), engine=EngineFacts(num_layers, saes),
                                                consumers={n: s.cls for n, s in setups.items()}, field="capture_global")
        # Tensor-parallel ranks hold identical residual rows: rank 0 alone runs consumers, except those every
        # rank needs.
        runners = {}
        first_rank = get_tensor_model_parallel_rank() == 0
        for name, setup in setups.items():
            if first_rank or setup.cls.every_rank:
                context = ConsumerContext(
                    name=name, options=setup.options, model=str(model_config.served_model_name),
                    num_layers=num_layers, hidden_size=model_config.get_hidden_size(),
                    pipeline_rank=get_pp_group().rank_in_group, pipeline_size=get_pp_group().world_size, saes=saes,
                )
                runners[name] = ConsumerRunner(consumer_host(setup.cls, context, setup.isolation),
                                               policy=config.capture_overload_policy,
                                               queue_bytes=setup.queue_bytes, spill_dir=setup.spill_dir)
        return CaptureStore(bank, num_layers=num_layers, model=str(model_config.served_model_name),
                            consumers=runners, global_spec=global_spec, external_id=request_ids.external_request_id,
                            max_graph_tokens=max_graph_tokens)

    def interp_describe_sites(self) -> dict[str, Any]:
        return {**self.model_runner.interp_store.bank.descriptor(), "runner": self.interp_runner}

    def interp_capture_steps(self) -> dict[str, float]:
        """How many steps read rows inside replayed CUDA graphs, how many ran eagerly to read them, and how many
        of these were a steady batch's (planned and collected for the batch as a whole), and how many blocks of
        memory the consumers' hosts made for requests' rows rather than reused (``capture.isolation``); how many
        steps ran in all (capturing or not) and how many of them replayed a CUDA graph; how many asks for
        results the worker answered, in how many ms of its forward thread, and for how many requests' results,
        in how many ms from the requests' ends to their rows handed on, to their consumers done, to the answers
        (``CaptureStore.results_timeline``, summed); how many requests the scheduler reported finished with their
        final length, and how many positions past it their captures dropped (``CaptureStore.ends``: an async
        scheduler's step past a stop); this process's garbage collections
        per generation and their ms (``gc_clock``); on a GPU, also how many blocks torch's pinned cache (where
        captured rows land) pinned afresh, in how many ms, and unpinned."""
        model_runner = self.model_runner
        store = model_runner.interp_store
        counts: dict[str, float] = dict(store.read_steps)
        counts.update(steps=model_runner.interp_steps_planned, replayed=model_runner.interp_steps_replayed,
                      results_asks=store.results_asks["asks"], results_ms=store.results_asks["seconds"] * 1000)
        timeline = store.results_timeline
        counts["results_answered"] = timeline["answered"]
        counts.update({f"results_{stage}_ms": timeline[f"{stage}_s"] * 1000 for stage in ("land", "consume", "claim")})
        counts.update(store.ends)
        counts["blocks_made"] = sum(runner.host.blocks_made for runner in store.consumers.values())
        counts.update(self.interp_gc_clock.counts())
        if torch.cuda.is_available():
            stats = torch.cuda.host_memory_stats()
            counts.update(pinned=stats.get("num_host_alloc", 0), unpinned=stats.get("num_host_free", 0),
                          pinned_ms=stats.get("host_alloc_time.total", 0) / 1000)
        return counts

    def interp_switch_interval(self, ms: float | None = None) -> float:
        """Python's switch interval in this worker's process, in ms, after setting it to ``ms`` where given: the
        serving benchmarks compare intervals on one running server, round by round."""
        if ms is not None:
            if not 0 < ms <= 1000:
                raise ValueError(f"switch interval must be within (0, 1000] ms, got {ms}")
            sys.setswitchinterval(ms / 1000)
        return sys.getswitchinterval() * 1000

    def interp_set_global_steering(self, wire: dict[str, Any]) -> None:
        tables = self.model_runner.interp_steering
        if tables is None:
            raise RuntimeError("steering is not enabled on this engine")
        tables.set_global(SteeringVectors.from_wire(wire))

    def interp_capture_results(self, lengths: dict[str, int | None], wait_s: float) -> dict[str, Any]:
        """Per request key, each consumer's result (see CaptureStore.results) and, for a patched request,
        its patch status (under ``"patch"``)."""
        runner = self.model_runner
        done = runner.interp_store.results(lengths, wait_s)
        if runner.interp_patching is not None:
            for key, status in runner.interp_patching.statuses(list(done)).items():
                done[key][PATCH_RESULT] = status
        return done

    def interp_patch_sources(self) -> dict[str, dict[str, Any]]:
        """The source runs this worker holds, by run id."""
        return SOURCES.describe()

    def interp_delete_patch_source(self, run_id: str) -> bool:
        return SOURCES.delete(run_id)

    def shutdown(self) -> None:
        # Consumers finish what is queued (files published, shards flushed) before the process exits.
        store = getattr(getattr(self, "model_runner", None), "interp_store", None)
        if store is not None:
            store.close()
        super().shutdown()


class InterpGPUWorker(InterpWorkerMixin, Worker):
    pass
