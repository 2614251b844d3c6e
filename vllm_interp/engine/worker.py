"""The worker mixin, and vLLM's GPU worker with it: the hook sites, installed right after the model loads.

``load_model`` runs before the profile run (the first Dynamo trace) and before CUDA-graph capture, so
every compiled graph contains the sites. The runner's class is swapped for one with the
``InterpRunnerMixin``; the read-out store is attached to it.
"""

from typing import Any

from vllm.distributed import get_tensor_model_parallel_rank
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.gpu_worker import Worker

from vllm_interp.capture.readout_store import ReadoutStore
from vllm_interp.compat import check_vllm_version
from vllm_interp.config import InterpConfig
from vllm_interp.engine.runner import with_interp_runner
from vllm_interp.models.registry import install_sites
from vllm_interp.steering.tables import SteeringTables, table_rows
from vllm_interp.steering.vectors import SteeringVectors


class InterpWorkerMixin:
    def load_model(self, *args: Any, **kwargs: Any) -> None:
        check_vllm_version()
        super().load_model(*args, **kwargs)
        config = InterpConfig.from_additional_config(self.vllm_config.additional_config) or InterpConfig()
        runner = self.model_runner
        if not isinstance(runner, GPUModelRunner):
            raise RuntimeError(
                f"vllm-interp hooks vLLM's V1 model runner, but this worker runs {type(runner).__name__}; "
                "set VLLM_USE_V2_MODEL_RUNNER=0 (vllm_interp.LLM and `vllm-interp serve` do so by default)"
            )
        model_config = self.vllm_config.model_config
        steer_rows = table_rows(config.max_steering_configs) if config.enable_steering else 1
        bank = install_sites(
            runner.get_model(),
            hidden_size=model_config.get_hidden_size(),
            dtype=model_config.dtype,
            device=runner.device,
            # No read-out: zero read slots, so even a replayed CUDA graph reads nothing.
            max_rows=config.max_readout_rows if config.enable_readout else 0,
            max_tokens=runner.max_num_tokens,
            steer_rows=steer_rows,
        )
        runner.__class__ = with_interp_runner(type(runner))
        num_layers = model_config.get_total_num_hidden_layers()
        runner.interp_store = ReadoutStore(bank, num_layers=num_layers, max_rows=config.max_readout_rows)
        runner.interp_steering = SteeringTables(bank, config.max_steering_configs) if config.enable_steering else None
        # Tensor-parallel ranks hold identical residual rows: rank 0 alone reports them.
        self._interp_reports = get_tensor_model_parallel_rank() == 0

    def interp_describe_sites(self) -> dict[str, Any]:
        return self.model_runner.interp_store.bank.descriptor()

    def interp_set_global_steering(self, wire: dict[str, Any]) -> None:
        tables = self.model_runner.interp_steering
        if tables is None:
            raise RuntimeError("steering is not enabled on this engine")
        tables.set_global(SteeringVectors.from_wire(wire))

    def interp_take_readouts(self, keys: list[str]) -> dict[str, dict[str, Any]]:
        taken = self.model_runner.interp_store.take(keys)
        return taken if self._interp_reports else {}


class InterpGPUWorker(InterpWorkerMixin, Worker):
    pass
