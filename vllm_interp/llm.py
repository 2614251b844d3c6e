"""``vllm_interp.LLM``: vLLM's offline ``LLM`` plus the interpretability options."""

from collections.abc import Sequence
from typing import Any
from uuid import uuid4

import vllm
from vllm import RequestOutput, SamplingParams

from vllm_interp.capture.readout import ReadoutSpec, ResidualReadout, merge_wire, validate_readout_spec
from vllm_interp.compat import check_vllm_version
from vllm_interp.config import DEFAULT_MAX_READOUT_ROWS, DEFAULT_MAX_STEERING_CONFIGS, InterpConfig
from vllm_interp.default_model import resolve_model
from vllm_interp.engine.args import check_model_architecture, interp_engine_args
from vllm_interp.request_args import EXTRA_ARGS_KEY
from vllm_interp.steering.params import raw_steering_fields
from vllm_interp.steering.state import SteeringState
from vllm_interp.steering.vectors import ModelShape, SteeringVectors

ReadoutArg = ReadoutSpec | dict[str, Any] | Sequence[ReadoutSpec | dict[str, Any] | None] | None


class LLM(vllm.LLM):
    """vLLM's ``LLM`` with hook sites in the forward pass.

    ``model`` defaults to SmolLM2-135M-Instruct (built on first use). ``enable_readout`` (default on)
    lets ``generate``/``chat`` return residual rows: pass ``readout=`` and read ``output.residuals``.
    The other flags are the steering, patching and capture subsystems; with any of them on, an
    architecture vllm-interp cannot hook is refused before the engine starts.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        enable_readout: bool = True,
        max_readout_rows: int = DEFAULT_MAX_READOUT_ROWS,
        enable_steering: bool = False,
        max_steering_configs: int = DEFAULT_MAX_STEERING_CONFIGS,
        enable_patching: bool = False,
        capture_consumers: Sequence[str] = (),
        **kwargs: Any,
    ) -> None:
        check_vllm_version()
        model = resolve_model(model)
        self.interp_config = InterpConfig(
            enable_steering=enable_steering,
            max_steering_configs=max_steering_configs,
            enable_patching=enable_patching,
            capture_consumers=tuple(capture_consumers),
            enable_readout=enable_readout,
            max_readout_rows=max_readout_rows,
        )
        if self.interp_config.hooks_needed:
            check_model_architecture(
                model,
                model_impl=kwargs.get("model_impl", "auto"),
                trust_remote_code=kwargs.get("trust_remote_code", False),
            )
        kwargs["worker_cls"], kwargs["additional_config"] = interp_engine_args(
            self.interp_config,
            worker_cls=kwargs.get("worker_cls", "auto"),
            additional_config=kwargs.get("additional_config"),
        )
        super().__init__(model=model, **kwargs)
        model_config = self.llm_engine.model_config
        self.num_layers = model_config.get_total_num_hidden_layers()
        self.steering = SteeringState(ModelShape(self.num_layers, model_config.get_hidden_size()),
                                      enabled=enable_steering)

    def generate(self, prompts: Any, sampling_params: Any = None, *, readout: ReadoutArg = None, **kwargs: Any):
        """vLLM's ``generate``; ``readout=`` returns residual rows on ``output.residuals``, and sampling
        params built with ``vllm_interp.steered_params`` are steered."""
        params, keys = self._prepare(_count_prompts(prompts), sampling_params, readout)
        return self._attach_readouts(super().generate(prompts, params, **kwargs), keys)

    def chat(self, messages: Any, sampling_params: Any = None, *, readout: ReadoutArg = None, **kwargs: Any):
        count = 1 if messages and isinstance(messages[0], dict) else len(messages)
        params, keys = self._prepare(count, sampling_params, readout)
        return self._attach_readouts(super().chat(messages, params, **kwargs), keys)

    # -- steering (the offline twins of /v1/steering/*) ------------------------------------------------
    def set_steering(self, vectors: Any = None, prefill_vectors: Any = None, decode_vectors: Any = None,
                     *, replace: bool = False) -> dict[str, Any]:
        """Set global steering (every request, from the next step on); returns the new global state."""
        spec = {"vectors": vectors, "prefill_vectors": prefill_vectors, "decode_vectors": decode_vectors}
        self._apply_global_steering(self.steering.plan_set(spec, replace=replace))
        return self.steering.describe()

    def clear_steering(self) -> None:
        self._apply_global_steering(self.steering.plan_clear())

    def _apply_global_steering(self, vectors: SteeringVectors) -> None:
        # Through the same queue as execute_model: every worker has the vectors before the next step.
        self.collective_rpc("interp_set_global_steering", args=(vectors.to_wire(),))
        self.steering.commit(vectors)

    def get_steering(self) -> dict[str, Any]:
        return self.steering.describe()

    def register_steering_vectors(self, name: str, vectors: Any = None, prefill_vectors: Any = None,
                                  decode_vectors: Any = None) -> None:
        """Register vectors a request can use by ``steering_name``."""
        spec = {"vectors": vectors, "prefill_vectors": prefill_vectors, "decode_vectors": decode_vectors}
        self.steering.register(name, spec)

    def unregister_steering_vectors(self, name: str) -> None:
        self.steering.unregister(name)

    def list_steering_vectors(self) -> list[str]:
        return sorted(self.steering.named)

    def shutdown(self) -> None:
        """Stop the engine processes now (rather than at garbage collection)."""
        self.llm_engine.engine_core.shutdown()

    def describe_sites(self) -> list[dict[str, Any]]:
        """The installed sites on each worker (layers held, hooks, read buffer rows)."""
        return self.collective_rpc("interp_describe_sites")

    def _prepare(self, count: int, sampling_params: Any, readout: ReadoutArg) -> tuple[Any, list[str | None]]:
        """Per-prompt SamplingParams with the vllm-interp payload in ``extra_args``; read-out keys."""
        if readout is not None and not self.interp_config.enable_readout:
            raise ValueError("readout= needs an engine built with enable_readout=True")
        specs = list(readout) if isinstance(readout, Sequence) else [readout] * count
        if len(specs) != count:
            raise ValueError(f"readout: got {len(specs)} specs for {count} prompts")
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        base = list(sampling_params) if isinstance(sampling_params, Sequence) else [sampling_params] * count
        if len(base) != count:
            raise ValueError(f"sampling_params: got {len(base)} for {count} prompts")
        params: list[SamplingParams] = []
        keys: list[str | None] = []
        # One SamplingParams shared by many prompts is validated once.
        payloads: dict[int, dict[str, Any]] = {}
        for spec, param in zip(specs, base, strict=True):
            if id(param) not in payloads:
                payloads[id(param)] = self.steering.request_payload(raw_steering_fields(param))
            payload = dict(payloads[id(param)])
            key = None
            if spec is not None:
                spec = validate_readout_spec(spec, num_layers=self.num_layers)
                if param.n > 1:
                    raise ValueError("readout: SamplingParams.n > 1 is not supported; submit the prompt n times")
                key = uuid4().hex
                payload.update(readout=spec.model_dump(mode="json"), readout_key=key)
            param = param.clone()
            # The normalised payload replaces whatever the caller put under our key (the raw fields of
            # steered_params included): nothing unvalidated reaches the engine.
            param.extra_args = {**(param.extra_args or {}), EXTRA_ARGS_KEY: payload}
            if key is not None:
                # Rows served from the prefix cache are never computed, so they could not be read.
                param.skip_reading_prefix_cache = True
            params.append(param)
            keys.append(key)
        return params, keys

    def _attach_readouts(self, outputs: list[RequestOutput], keys: list[str | None]) -> list[RequestOutput]:
        wanted = [key for key in keys if key is not None]
        if not wanted:
            return outputs
        per_rank = self.collective_rpc("interp_take_readouts", args=(wanted,))
        for output, key in zip(outputs, keys, strict=True):
            if key is None:
                continue
            parts = [rank[key] for rank in per_rank if key in rank]
            if not parts:
                raise RuntimeError(f"request {output.request_id}: no worker holds its read-out")
            output.residuals = ResidualReadout.from_wire(merge_wire(parts))
        return outputs


def _count_prompts(prompts: Any) -> int:
    """How many prompts vLLM will see (a str, a dict or a flat token-id list is a single prompt)."""
    if isinstance(prompts, str | dict):
        return 1
    if isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int):
        return 1
    return len(prompts)
