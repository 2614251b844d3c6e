"""ASGI middleware: vllm-interp's top-level fields on /v1/completions and /v1/chat/completions.

vLLM ignores unknown top-level fields, so the fields are taken out of the JSON body here, validated (a bad
spec is answered with 400 naming the field, before vLLM sees the request), and replaced by the normalised
payload in ``vllm_xargs["vllm_interp"]`` (a JSON string: ``vllm_xargs`` admits no nested objects), which
vLLM copies into ``SamplingParams.extra_args``. Requests are stamped even without fields of their own while
global steering is set, so that their prefix-cache keys cover the global vectors.
"""

import json
from typing import Any

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from vllm_interp.request_args import EXTRA_ARGS_KEY
from vllm_interp.server.protocol import SteeringRequestFields, error_body
from vllm_interp.steering.vectors import SteeringError

GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
FIELDS = tuple(SteeringRequestFields.model_fields)


def steering_error_response(exc: SteeringError) -> JSONResponse:
    message = str(exc)
    return JSONResponse(error_body(message, param=message.split(":", 1)[0]), status_code=400)


class RequestFieldsMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        body = await _read_body(receive)
        rewritten = self._rewrite(scope, body)
        if isinstance(rewritten, JSONResponse):
            await rewritten(scope, receive, send)
            return
        await self.app(_with_length(scope, len(rewritten)), _replay(rewritten, receive), send)

    def _rewrite(self, scope: Scope, body: bytes) -> bytes | JSONResponse:
        steering = getattr(scope["app"].state, "vllm_interp_steering", None)
        try:
            data = json.loads(body)
        except ValueError:
            return body  # not JSON: vLLM answers with its own error
        if not isinstance(data, dict) or steering is None:
            return body
        xargs = data.get("vllm_xargs")
        if isinstance(xargs, dict) and EXTRA_ARGS_KEY in xargs:
            # Only this middleware writes the normalised payload; a client-made one would skip validation.
            param = f"vllm_xargs.{EXTRA_ARGS_KEY}"
            return JSONResponse(error_body(f"{param}: reserved for vllm-interp; use its request fields",
                                           param=param), status_code=400)
        fields = {name: data.pop(name) for name in FIELDS if name in data}
        try:
            SteeringRequestFields.model_validate(fields)
            payload = steering.request_payload(fields)
        except SteeringError as exc:
            return steering_error_response(exc)
        except ValueError as exc:  # pydantic: a field of the wrong JSON type
            first = exc.errors()[0] if hasattr(exc, "errors") else {"loc": (), "msg": str(exc)}
            param = ".".join(map(str, first["loc"]))
            return JSONResponse(error_body(f"{param}: {first['msg']}", param=param), status_code=400)
        if not fields and not payload:
            return body
        if payload:
            xargs: dict[str, Any] = data.get("vllm_xargs") or {}
            xargs[EXTRA_ARGS_KEY] = json.dumps(payload)
            data["vllm_xargs"] = xargs
        return json.dumps(data).encode()


async def _read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """Hand the (rewritten) body over once, then the client's own messages: vLLM keeps listening for the
    disconnect that cancels a request."""
    sent = False

    async def replay() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _with_length(scope: Scope, length: int) -> Scope:
    headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
    return {**scope, "headers": [*headers, (b"content-length", str(length).encode())]}
