"""Monkeypatch: the HTTP middleware's payload reaches ``SamplingParams.extra_args`` without a JSON detour.

Wraps ``CompletionRequest.to_sampling_params`` and ``ChatCompletionRequest.to_sampling_params`` (vLLM 0.26),
which vLLM's OpenAI handlers call to build each request's sampling parameters. The only public way in is
``vllm_xargs``, which admits no nested objects: the payload (steering vectors alone are 100+ KB for an
all-layer request) would have to be dumped to a JSON string, written into the rewritten body, parsed again
by vLLM and loaded again by the engine core, all on the API server's one event loop, where it is paid by
every request queued behind it. Instead the middleware sets ``request_args.HTTP_PAYLOAD`` for the request's
task and the wrapped methods put the payload, as is, under ``extra_args["vllm_interp"]``.
"""

from typing import Any

from vllm_interp.engine.touchpoints import Touchpoint, check_touchpoints
from vllm_interp.request_args import EXTRA_ARGS_KEY, HTTP_PAYLOAD

_REQUESTS = ("vllm.entrypoints.openai.completion.protocol:CompletionRequest",
             "vllm.entrypoints.openai.chat_completion.protocol:ChatCompletionRequest")
TOUCHPOINTS = tuple(
    Touchpoint(f"{cls}.to_sampling_params", "patch",
               "vLLM's handlers build each request's sampling params here; the middleware's payload joins extra_args")
    for cls in _REQUESTS
)
_installed = False


def install() -> None:
    """Wrap both methods (idempotent); refuses to start on a vLLM whose methods moved."""
    global _installed
    if _installed:
        return
    check_touchpoints(TOUCHPOINTS)
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    for cls in (CompletionRequest, ChatCompletionRequest):
        cls.to_sampling_params = _with_payload(cls.to_sampling_params)
    _installed = True


def _with_payload(original: Any) -> Any:
    def to_sampling_params(self, *args: Any, **kwargs: Any) -> Any:
        params = original(self, *args, **kwargs)
        payload = HTTP_PAYLOAD.get()
        if payload is not None:
            params.extra_args = {**(params.extra_args or {}), EXTRA_ARGS_KEY: payload}
        return params

    return to_sampling_params
