"""Clients of a `vllm-interp serve` server (no vLLM import): ``PatchStudy`` for causal tracing."""

from vllm_interp.client.patch_study import PatchStudy, SweepResult

__all__ = ["PatchStudy", "SweepResult"]
