"""The offline helper: SamplingParams that carry a steering spec."""

from typing import Any

from vllm import SamplingParams

from vllm_interp.request_args import interp_args, with_interp_args
from vllm_interp.steering.state import NAME_FIELD, RAW_KEY
from vllm_interp.steering.vectors import REQUEST_FIELDS


def steered_params(
    params: SamplingParams | None = None,
    *,
    steering_vectors: Any = None,
    prefill_steering_vectors: Any = None,
    decode_steering_vectors: Any = None,
    steering_name: str | None = None,
) -> SamplingParams:
    """A copy of ``params`` (default: greedy defaults of SamplingParams) carrying a steering spec.

    The spec is validated and normalised when ``vllm_interp.LLM.generate``/``chat`` submits the request:
    pass these params only there (plain ``vllm.LLM`` does not know the fields and would run unsteered).
    """
    params = (params or SamplingParams()).clone()
    given = {
        REQUEST_FIELDS["base"]: steering_vectors,
        REQUEST_FIELDS["prefill"]: prefill_steering_vectors,
        REQUEST_FIELDS["decode"]: decode_steering_vectors,
        NAME_FIELD: steering_name,
    }
    raw = {field: value for field, value in given.items() if value is not None}
    params.extra_args = with_interp_args(params.extra_args, **{RAW_KEY: raw})
    return params


def raw_steering_fields(params: SamplingParams) -> dict[str, Any]:
    return interp_args(params.extra_args).get(RAW_KEY) or {}
