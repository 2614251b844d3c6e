"""Clients of a `vllm-interp serve` server (no vLLM import): ``PatchStudy`` for causal tracing."""

from typing import Any

__all__ = ["PatchStudy", "SweepResult"]


def __getattr__(name: str) -> Any:
    # Imported on first use: `vllm-interp serve` builds the `trace` subcommand's parser from this package and
    # must run where the client extra (httpx, httpx-sse) is not installed.
    if name in __all__:
        from vllm_interp.client import patch_study

        return getattr(patch_study, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
