"""Turning an InterpConfig into vLLM engine arguments (shared by the offline LLM and `vllm-interp serve`)."""

from typing import Any

from vllm_interp.capture.plugins import configure_consumers
from vllm_interp.config import InterpConfig
from vllm_interp.engine.versions import adapter
from vllm_interp.models.registry import check_architecture


def platform_worker_cls() -> str:
    from vllm.platforms import current_platform

    internals = adapter()
    return internals.CPU_WORKER if current_platform.is_cpu() else internals.GPU_WORKER


def check_model_architecture(model: str, *, model_impl: str = "auto", trust_remote_code: bool = False) -> None:
    """Fail before an engine is built when the model's architecture cannot be hooked."""
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
    check_architecture(list(getattr(hf_config, "architectures", None) or [type(hf_config).__name__]), model_impl)


def interp_engine_args(
    config: InterpConfig, *, worker_cls: str, additional_config: dict[str, Any] | None
) -> tuple[str, dict[str, Any] | None]:
    """The ``(worker_cls, additional_config)`` an engine with ``config`` runs with.

    With no feature enabled the engine is plain vLLM. Otherwise the worker class installs the hooks and
    ``additional_config`` carries the config (and with it the site scheme and package version), which
    vLLM hashes into its compile-cache key.
    """
    if not config.hooks_needed:
        return worker_cls, additional_config
    # Unknown consumers and bad options fail here, before an engine starts.
    configure_consumers(config.consumers)
    internals = adapter()
    if worker_cls not in ("auto", internals.CPU_WORKER, internals.GPU_WORKER):
        raise ValueError(f"vllm-interp needs its own worker class; got worker_cls={worker_cls!r}")
    return platform_worker_cls(), config.to_additional_config(additional_config)
