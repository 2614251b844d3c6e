"""ASGI middleware: vllm-interp's top-level fields on /v1/completions and /v1/chat/completions.

vLLM ignores unknown top-level fields, so the fields are taken out of the JSON body here, validated (a bad
spec is answered with 400 naming the field, before vLLM sees the request), and replaced by the normalised
payload in ``vllm_xargs["vllm_interp"]`` (a JSON string: ``vllm_xargs`` admits no nested objects), which
vLLM copies into ``SamplingParams.extra_args``. Requests are stamped even without fields of their own while
global steering is set, so that their prefix-cache keys cover the global vectors.

A non-streaming request with ``capture`` gets a capture key; once vLLM's response is complete, the
consumers' results for that key are fetched from the workers and added to the JSON body as
``capture_results``. Streaming responses carry no results (the consumers still receive the rows).
"""

import asyncio
import json
import time
from typing import Any
from uuid import uuid4

from pydantic import ValidationError
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from vllm_interp.capture.results import ResultCollector, result_to_json
from vllm_interp.capture.spec import CaptureSpecError, spec_to_wire, validate_capture_spec
from vllm_interp.request_args import EXTRA_ARGS_KEY
from vllm_interp.server.protocol import STEERING_FIELDS, InterpRequestFields, error_body
from vllm_interp.steering.vectors import SteeringError

GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
FIELDS = tuple(InterpRequestFields.model_fields)
RESULTS_TIMEOUT_S = 600.0


def field_error_response(exc: ValueError) -> JSONResponse:
    """400 for a SteeringError/CaptureSpecError, whose message starts with the field's path."""
    message = str(exc)
    return JSONResponse(error_body(message, param=message.split(":", 1)[0]), status_code=400)


def _bad_request(param: str, message: str) -> JSONResponse:
    return JSONResponse(error_body(f"{param}: {message}", param=param), status_code=400)


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
        body, capture = rewritten
        app_scope, app_receive = _with_length(scope, len(body)), _replay(body, receive)
        if capture is None:
            await self.app(app_scope, app_receive, send)
            return
        response = _BufferedResponse()
        await self.app(app_scope, app_receive, response.send)
        await response.replay(send, await self._results_for(scope, response, *capture))

    def _rewrite(self, scope: Scope, body: bytes) -> tuple[bytes, tuple[str, list[str]] | None] | JSONResponse:
        state = scope["app"].state
        steering = getattr(state, "vllm_interp_steering", None)
        try:
            data = json.loads(body)
        except ValueError:
            return body, None  # not JSON: vLLM answers with its own error
        if not isinstance(data, dict) or steering is None:
            return body, None
        xargs = data.get("vllm_xargs")
        if isinstance(xargs, dict) and EXTRA_ARGS_KEY in xargs:
            # Only this middleware writes the normalised payload; a client-made one would skip validation.
            return _bad_request(f"vllm_xargs.{EXTRA_ARGS_KEY}", "reserved for vllm-interp; use its request fields")
        fields = {name: data.pop(name) for name in FIELDS if name in data}
        try:
            InterpRequestFields.model_validate(fields)
            payload = steering.request_payload({k: v for k, v in fields.items() if k in STEERING_FIELDS})
            capture = self._capture_payload(state, data, fields.get("capture"), payload)
        except (SteeringError, CaptureSpecError) as exc:
            return field_error_response(exc)
        except ValidationError as exc:  # a field of the wrong JSON type
            first = exc.errors()[0]
            return _bad_request(".".join(map(str, first["loc"])), first["msg"])
        if payload:
            xargs: dict[str, Any] = data.get("vllm_xargs") or {}
            xargs[EXTRA_ARGS_KEY] = json.dumps(payload)
            data["vllm_xargs"] = xargs
        if not fields and not payload:
            return body, None
        return json.dumps(data).encode(), capture

    @staticmethod
    def _capture_payload(state: Any, data: dict[str, Any], raw: Any,
                         payload: dict[str, Any]) -> tuple[str, list[str]] | None:
        """Validate ``capture`` into ``payload``; the (key, consumers) whose results the response carries."""
        if raw is None:
            return None
        consumers = getattr(state, "vllm_interp_consumers", {})
        spec = validate_capture_spec(raw, num_layers=state.vllm_interp_num_layers, consumers=consumers)
        if data.get("n", 1) != 1:
            raise CaptureSpecError("capture: n > 1 is not supported with capture; send the prompt n times")
        payload["capture"] = spec_to_wire(spec)
        if data.get("stream"):
            return None
        key = uuid4().hex
        payload["capture_key"] = key
        return key, list(spec)

    async def _results_for(self, scope: Scope, response: "_BufferedResponse", key: str,
                           consumers: list[str]) -> dict[str, Any] | None:
        """The consumers' results for a finished request; None when vLLM answered with an error."""
        body = response.json()
        if response.status != 200 or body is None:
            return None
        usage = body.get("usage") or {}
        length = int(usage.get("prompt_tokens", 0)) + int(usage.get("completion_tokens", 0))
        state = scope["app"].state
        collector = ResultCollector({key: length}, {key: consumers})
        deadline = time.monotonic() + RESULTS_TIMEOUT_S
        while collector.pending and time.monotonic() < deadline:
            per_rank = await state.engine_client.collective_rpc("interp_capture_results", args=(collector.pending, 0.0))
            collector.add(per_rank)
            if collector.pending:
                await asyncio.sleep(0.05)
        consumers = state.vllm_interp_consumers
        merged = collector.merged(consumers)
        body["capture_results"] = {
            name: result_to_json(result, consumers[name].result_to_json) for name, result in merged[key].items()
        }
        return body


class _BufferedResponse:
    """Holds vLLM's response until capture results can be added to its body."""

    def __init__(self) -> None:
        self.start: Message | None = None
        self.chunks: list[bytes] = []

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.start = message
        elif message["type"] == "http.response.body":
            self.chunks.append(message.get("body", b""))

    @property
    def status(self) -> int:
        return self.start["status"] if self.start else 500

    def json(self) -> dict[str, Any] | None:
        try:
            data = json.loads(b"".join(self.chunks))
        except ValueError:
            return None
        return data if isinstance(data, dict) else None

    async def replay(self, send: Send, body: dict[str, Any] | None) -> None:
        content = b"".join(self.chunks) if body is None else json.dumps(body).encode()
        headers = [(k, v) for k, v in (self.start or {}).get("headers", []) if k.lower() != b"content-length"]
        await send({"type": "http.response.start", "status": self.status,
                    "headers": [*headers, (b"content-length", str(len(content)).encode())]})
        await send({"type": "http.response.body", "body": content, "more_body": False})


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
