"""The offline helper: SamplingParams that carry a patch spec."""

from typing import Any

from vllm import SamplingParams

from vllm_interp.request_args import interp_args, with_interp_args

# The raw spec as offline callers put it in extra_args; vllm_interp.LLM validates it on submission.
RAW_KEY = "patch_request"


def patched_params(params: SamplingParams | None = None, *, patch: list[dict[str, Any]]) -> SamplingParams:
    """A copy of ``params`` carrying ``patch`` (a list of ``{layer, hook, position, alpha, source}``; see
    ``vllm_interp.patching.spec``). Validated when ``vllm_interp.LLM.generate``/``chat`` submits the request:
    pass these params only there (plain ``vllm.LLM`` would run the request unpatched)."""
    params = (params or SamplingParams()).clone()
    params.extra_args = with_interp_args(params.extra_args, **{RAW_KEY: list(patch)})
    return params


def raw_patch(params: SamplingParams) -> list[dict[str, Any]] | None:
    return interp_args(params.extra_args).get(RAW_KEY)
