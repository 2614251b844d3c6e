"""``vllm_interp.LLM``: vLLM's offline ``LLM`` plus the interpretability options."""

import json
from collections.abc import Mapping, Sequence
from typing import Any

import vllm
from vllm import RequestOutput, SamplingParams

from vllm_interp.capture.consumers.inline import ResidualReadout
from vllm_interp.capture.limits import check_capture_bytes
from vllm_interp.capture.spec import CaptureSpec
from vllm_interp.config import (
    DEFAULT_MAX_PATCH_ROWS,
    DEFAULT_MAX_STEERING_CONFIGS,
    FrontendLimits,
    InterpConfig,
)
from vllm_interp.default_model import resolve_model
from vllm_interp.engine.args import check_model_architecture, interp_engine_args
from vllm_interp.engine.versions import adapter, check_vllm_version
from vllm_interp.frontend import (
    RESULTS_RPC,
    SOURCES_RPC,
    InterpFrontend,
    PreparedRequest,
    collect_results,
    combined_generations,
    merged_sources,
)
from vllm_interp.hooks import ModelShape
from vllm_interp.patching.params import raw_patch
from vllm_interp.patching.spec import PatchError, PatchSpec
from vllm_interp.patching.tables import PATCH_RESULT
from vllm_interp.request_args import EXTRA_ARGS_KEY
from vllm_interp.steering.contrastive import ContrastiveVectors, contrastive_vectors, validate_contrastive
from vllm_interp.steering.params import raw_steering_fields
from vllm_interp.steering.vectors import SteeringVectors

SpecArg = dict[str, Any] | Sequence[dict[str, Any] | None] | None


class CaptureError(RuntimeError):
    """``readout=`` could not return every requested row (the inline consumer's status was not ok)."""


class PatchFailed(RuntimeError):
    """A patched request could not be patched as specified (its output is not a patched result)."""


class LLM(vllm.LLM):
    """vLLM's ``LLM`` with hook sites in the forward pass.

    ``model`` defaults to SmolLM2-135M-Instruct (built on first use). ``capture_consumers`` enables capture
    consumers (``"name:key=val,..."``; default: ``inline``, which returns rows to the caller); pass
    ``capture=`` to ``generate``/``chat`` and read ``output.capture`` (per consumer results) and, for the
    inline consumer, ``output.residuals``. ``readout=spec`` is short for ``capture={"inline": spec}`` that
    raises unless every row came back. The other flags are the steering and patching subsystems: sampling
    params built with ``steered_params`` are steered, those built with ``patched_params`` patched (read
    ``output.patch``; a patch that could not be applied raises ``PatchFailed``), and ``enable_patching``
    adds the ``patch_source`` consumer whose runs ``patch_sources``/``delete_patch_source`` manage.
    ``saes={"name": dir}`` loads sparse autoencoders (SAELens's format) for feature steering entries and the
    ``sae_features`` consumer. ``limits`` bounds what requests may ask (``FrontendLimits``, the server's
    ``--max-*`` flags; see docs/limits.md). With any
    feature on, an architecture vllm-interp cannot hook is refused before the engine starts.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        capture_consumers: Sequence[str] = ("inline",),
        capture_global: dict[str, Any] | None = None,
        capture_overload_policy: str = "block",
        engine_switch_interval_ms: float = 0.0,
        enable_steering: bool = False,
        max_steering_configs: int = DEFAULT_MAX_STEERING_CONFIGS,
        enable_patching: bool = False,
        max_patch_rows: int = DEFAULT_MAX_PATCH_ROWS,
        patch_source_bytes: int | None = None,
        max_graph_capture_rows: int | None = None,
        saes: Mapping[str, str] | None = None,
        limits: FrontendLimits | None = None,
        **kwargs: Any,
    ) -> None:
        check_vllm_version()
        model = resolve_model(model)
        self.interp_config = InterpConfig(
            enable_steering=enable_steering,
            max_steering_configs=max_steering_configs,
            enable_patching=enable_patching,
            max_patch_rows=max_patch_rows,
            **({"patch_source_bytes": patch_source_bytes} if patch_source_bytes is not None else {}),
            max_graph_capture_rows=max_graph_capture_rows,
            capture_consumers=tuple(capture_consumers),
            capture_global=json.dumps(capture_global) if capture_global else "",
            capture_overload_policy=capture_overload_policy,
            engine_switch_interval_ms=engine_switch_interval_ms,
            saes=tuple(f"{name}={directory}" for name, directory in (saes or {}).items()),
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
        adapter("offline").check_llm(self)
        model_config = self.llm_engine.model_config
        self.num_layers = model_config.get_total_num_hidden_layers()
        self.shape = ModelShape(self.num_layers, model_config.get_hidden_size())
        self.frontend = InterpFrontend.for_engine(self.interp_config, self.shape, limits)
        self.steering = self.frontend.steering
        self._consumers = self.frontend.consumers

    def generate(self, prompts: Any, sampling_params: Any = None, *, capture: SpecArg = None,
                 readout: SpecArg = None, **kwargs: Any):
        """vLLM's ``generate``; ``capture=`` sends residual rows to consumers (``output.capture``),
        ``readout=`` returns them (``output.residuals``), and sampling params built with
        ``vllm_interp.steered_params`` are steered."""
        listed = _listed_prompts(prompts)
        captures = self._capture_specs(len(listed), capture, readout)
        params, prepared = self._prepare(len(listed), sampling_params, captures, listed)
        _refuse_patched_media(listed, prepared)
        outputs = super().generate(prompts, params, **kwargs)
        return self._attach_results(outputs, prepared, strict=readout is not None)

    def chat(self, messages: Any, sampling_params: Any = None, *, capture: SpecArg = None,
             readout: SpecArg = None, **kwargs: Any):
        count = 1 if messages and isinstance(messages[0], dict) else len(messages)
        captures = self._capture_specs(count, capture, readout)
        params, prepared = self._prepare(count, sampling_params, captures, [None] * count)
        outputs = super().chat(messages, params, **kwargs)
        return self._attach_results(outputs, prepared, strict=readout is not None)

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

    def contrastive_vector(self, positive: Sequence[str], negative: Sequence[str], *, hook: str = "post_block",
                           layers: Sequence[int] | str, positions: str = "last_prompt", normalize: bool = False,
                           name: str | None = None) -> ContrastiveVectors:
        """mean(positive) - mean(negative) of the residual stream at ``hook`` of ``layers`` (see
        ``vllm_interp.steering.contrastive``), all prompts in one batch; registered under ``name`` if given.
        ``result.steering_spec(scale)`` is a ready steering spec; ``result.to_json()`` the HTTP answer."""
        request = validate_contrastive(
            {"positive": list(positive), "negative": list(negative), "hook": hook,
             "layers": layers if isinstance(layers, str) else list(layers), "positions": positions,
             "normalize": normalize, "name": name}, shape=self.shape, consumers=list(self._consumers))
        params = SamplingParams(temperature=0.0, max_tokens=1)
        outputs = self.generate(request.prompts, params, readout=request.capture_spec(self.num_layers)["inline"],
                                use_tqdm=False)
        result = contrastive_vectors(request, [output.residuals for output in outputs], self.num_layers)
        if name is not None:
            self.register_steering_vectors(name, result.steering_spec())
        return result

    def shutdown(self) -> None:
        """Stop the engine processes now (rather than at garbage collection)."""
        adapter("offline").shutdown(self)

    def describe_sites(self) -> list[dict[str, Any]]:
        """The installed sites on each worker (layers held, hooks) and the vLLM model runner it hooked (V1, V2)."""
        return self.collective_rpc("interp_describe_sites")

    def _capture_specs(self, count: int, capture: SpecArg, readout: SpecArg) -> list[CaptureSpec | None]:
        """One validated capture spec (or None) per prompt."""
        if capture is not None and readout is not None:
            raise ValueError("pass capture= or readout=, not both (readout=spec is capture={'inline': spec})")
        if readout is not None:
            if "inline" not in self._consumers:
                raise ValueError("readout= needs the inline capture consumer (capture_consumers=('inline', ...))")
            per_prompt = readout if isinstance(readout, Sequence) else [readout] * count
            capture = [None if r is None else {"inline": r} for r in per_prompt]
        if capture is None:
            return [None] * count
        specs = list(capture) if isinstance(capture, Sequence) else [capture] * count
        if len(specs) != count:
            raise ValueError(f"capture: got {len(specs)} specs for {count} prompts")
        # The same spec object for every prompt is validated once.
        validated: dict[int, CaptureSpec] = {}
        for spec in specs:
            if spec is not None and id(spec) not in validated:
                validated[id(spec)] = self.frontend.validate_capture(spec)
        return [None if spec is None else validated[id(spec)] for spec in specs]

    def _prepare(self, count: int, sampling_params: Any, captures: list[CaptureSpec | None],
                 prompts: list[Any]) -> tuple[list[SamplingParams], list[PreparedRequest]]:
        """Per-prompt SamplingParams with the vllm-interp payload in ``extra_args`` (``prompts``: each as given,
        or None where unknown, e.g. chat messages, for the capture-size bound)."""
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        base = list(sampling_params) if isinstance(sampling_params, Sequence) else [sampling_params] * count
        if len(base) != count:
            raise ValueError(f"sampling_params: got {len(base)} for {count} prompts")
        params: list[SamplingParams] = []
        prepared: list[PreparedRequest] = []
        patches = self._patch_specs(base)
        for spec, param, prompt in zip(captures, base, prompts, strict=True):
            if spec is not None:
                self._check_capture_bytes(spec, param, prompt)
            patch = patches.get(id(param))
            if (spec is not None or patch is not None) and param.n > 1:
                raise ValueError("capture and patch: SamplingParams.n > 1 is not supported; submit the prompt n times")
            request = self.frontend.prepare(raw_steering_fields(param), spec, patch, collect=True)
            param = param.clone()
            # The normalised payload replaces whatever the caller put under our key (the raw fields of
            # steered_params and patched_params included): nothing unvalidated reaches the engine.
            param.extra_args = {**(param.extra_args or {}), EXTRA_ARGS_KEY: request.payload}
            params.append(param)
            prepared.append(request)
        return params, prepared

    def _check_capture_bytes(self, spec: CaptureSpec, param: SamplingParams, prompt: Any) -> None:
        ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else prompt
        text = prompt.get("prompt") if isinstance(prompt, dict) else prompt
        check_capture_bytes(
            spec, consumers=self.frontend.consumers, num_layers=self.num_layers, hidden_size=self.shape.hidden_size,
            max_tokens=param.max_tokens,
            max_model_len=self.llm_engine.model_config.max_model_len,
            limit=self.frontend.limits.max_capture_bytes_per_request,
            prompt_len=len(ids) if isinstance(ids, list) else None,
            count_prompt=(lambda: len(self.get_tokenizer().encode(text))) if isinstance(text, str) else None)

    def _patch_specs(self, params: list[SamplingParams]) -> dict[int, PatchSpec]:
        """The validated patch spec of each distinct SamplingParams that carries one (validated once)."""
        raw = {id(p): spec for p in params if (spec := raw_patch(p)) is not None}
        if not raw:
            return {}
        generations = combined_generations(self.collective_rpc(SOURCES_RPC)) if self.interp_config.enable_patching \
            else {}
        specs = {}
        for key, spec in raw.items():
            validated = self.frontend.validate_patch(spec, generations.get)
            if validated is not None:
                specs[key] = validated
        return specs

    def _attach_results(self, outputs: list[RequestOutput], prepared: list[PreparedRequest], *,
                        strict: bool) -> list[RequestOutput]:
        by_key = {p.key: p for p in prepared if p.key is not None}
        if not by_key:
            return outputs
        lengths = {
            p.key: len(output.prompt_token_ids) + len(output.outputs[0].token_ids)
            for output, p in zip(outputs, prepared, strict=True) if p.key is not None
        }
        collector = self.frontend.collector(lengths, by_key)
        collect_results(collector, lambda pending, wait_s: self.collective_rpc(RESULTS_RPC, args=(pending, wait_s)))
        results = self.frontend.merged(collector)
        failed = []
        for output, p in zip(outputs, prepared, strict=True):
            if p.key is None:
                continue
            output.capture = {name: r for name, r in results[p.key].items() if name != PATCH_RESULT}
            output.patch = results[p.key].get(PATCH_RESULT)
            if output.patch is not None and output.patch.status != "ok":
                failed.append(f"request {output.request_id}: {output.patch.message}")
            inline = output.capture.get("inline")
            if inline is not None and inline.result is not None:
                output.residuals = ResidualReadout.from_result(inline.result)
            if strict and "inline" in p.expects and (inline is None or inline.status != "ok"):
                message = inline.message if inline is not None else "no result"
                raise CaptureError(f"request {output.request_id}: readout failed: {message}")
        if failed:
            raise PatchFailed("; ".join(failed))
        return outputs

    def patch_sources(self) -> dict[str, dict[str, Any]]:
        """The stored patch source runs (``patch_source`` captures), by run id, as the workers hold them."""
        return merged_sources(self.collective_rpc(SOURCES_RPC))

    def delete_patch_source(self, run_id: str) -> bool:
        """Forget a source run on every worker; whether any held it."""
        return any(self.collective_rpc("interp_delete_patch_source", args=(run_id,)))


def _refuse_patched_media(listed: list[Any], prepared: list[PreparedRequest]) -> None:
    """Patching is text-only: positions index text tokens, which multimodal placeholders would shift."""
    for prompt, request in zip(listed, prepared, strict=False):
        if "patch" in request.payload and isinstance(prompt, dict) and prompt.get("multi_modal_data"):
            raise PatchError("patch: patching is text-only; this prompt carries multimodal data")


def _listed_prompts(prompts: Any) -> list[Any]:
    """The prompts vLLM will see, as a list (a str, a dict or a flat token-id list is a single prompt)."""
    if isinstance(prompts, str | dict):
        return [prompts]
    if isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int):
        return [prompts]
    return list(prompts)
