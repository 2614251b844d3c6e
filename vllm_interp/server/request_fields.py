"""ASGI middleware: vllm-interp's top-level fields on /v1/completions and /v1/chat/completions.

vLLM ignores unknown top-level fields, so the fields are taken out of the JSON body here, validated (a bad
spec is answered with 400 naming the field, before vLLM sees the request), and replaced by the normalised
payload (``vllm_interp.frontend``) in ``vllm_xargs["vllm_interp"]`` (a JSON string: ``vllm_xargs`` admits
no nested objects), which vLLM copies into ``SamplingParams.extra_args``. Requests are stamped even without
fields of their own while global steering is set, so that their prefix-cache keys cover the global vectors.

A non-streaming request with ``capture`` or ``patch`` gets a key; once vLLM's response is complete, the
results for that key are fetched from the workers: the consumers' go into the JSON body as
``capture_results``; a patch that could not be applied as specified turns the response into a 409 error
(the completion is not a patched result). Streaming responses carry no results (the consumers still
receive the rows), so ``patch`` needs ``stream: false``.
"""

import json
from typing import Any

from pydantic import ValidationError
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from vllm_interp.capture.results import result_to_json
from vllm_interp.capture.spec import CaptureSpecError, validate_capture_spec
from vllm_interp.frontend import (
    RESULTS_RPC,
    SOURCES_RPC,
    InterpFrontend,
    PreparedRequest,
    collect_results_async,
    combined_generations,
)
from vllm_interp.patching.spec import FIELD as PATCH_FIELD
from vllm_interp.patching.spec import PatchError, PatchSpec
from vllm_interp.patching.tables import PATCH_RESULT
from vllm_interp.request_args import EXTRA_ARGS_KEY
from vllm_interp.server.protocol import STEERING_FIELDS, InterpRequestFields, error_body
from vllm_interp.steering.vectors import SteeringError

GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
FIELDS = tuple(InterpRequestFields.model_fields)


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
        rewritten = await self._rewrite(scope, body)
        if isinstance(rewritten, JSONResponse):
            await rewritten(scope, receive, send)
            return
        body, prepared = rewritten
        app_scope, app_receive = _with_length(scope, len(body)), _replay(body, receive)
        if prepared is None or prepared.key is None:
            await self.app(app_scope, app_receive, send)
            return
        response = _BufferedResponse()
        await self.app(app_scope, app_receive, response.send)
        await response.replay(send, *await self._results_for(scope, response, prepared))

    async def _rewrite(self, scope: Scope, body: bytes) -> tuple[bytes, PreparedRequest | None] | JSONResponse:
        state = scope["app"].state
        frontend: InterpFrontend | None = getattr(state, "vllm_interp_frontend", None)
        try:
            data = json.loads(body)
        except ValueError:
            return body, None  # not JSON: vLLM answers with its own error
        if not isinstance(data, dict) or frontend is None:
            return body, None
        xargs = data.get("vllm_xargs")
        if isinstance(xargs, dict) and EXTRA_ARGS_KEY in xargs:
            # Only this middleware writes the normalised payload; a client-made one would skip validation.
            return _bad_request(f"vllm_xargs.{EXTRA_ARGS_KEY}", "reserved for vllm-interp; use its request fields")
        fields = {name: data.pop(name) for name in FIELDS if name in data}
        try:
            InterpRequestFields.model_validate(fields)
            capture = self._capture_spec(state, data, fields.get("capture"))
            patch = await self._patch_spec(state, scope["path"], data, fields.get(PATCH_FIELD))
            steering_fields = {k: v for k, v in fields.items() if k in STEERING_FIELDS}
            prepared = frontend.prepare(steering_fields, capture, patch, collect=not data.get("stream"))
        except (SteeringError, CaptureSpecError, PatchError) as exc:
            return field_error_response(exc)
        except ValidationError as exc:  # a field of the wrong JSON type
            first = exc.errors()[0]
            return _bad_request(".".join(map(str, first["loc"])), first["msg"])
        if prepared.payload:
            xargs: dict[str, Any] = data.get("vllm_xargs") or {}
            xargs[EXTRA_ARGS_KEY] = json.dumps(prepared.payload)
            data["vllm_xargs"] = xargs
        if not fields and not prepared.payload:
            return body, None
        return json.dumps(data).encode(), prepared

    @staticmethod
    def _capture_spec(state: Any, data: dict[str, Any], raw: Any):
        if raw is None:
            return None
        spec = validate_capture_spec(raw, num_layers=state.vllm_interp_num_layers,
                                     consumers=state.vllm_interp_frontend.consumers)
        if data.get("n", 1) != 1:
            raise CaptureSpecError("capture: n > 1 is not supported with capture; send the prompt n times")
        return spec

    @staticmethod
    async def _patch_spec(state: Any, path: str, data: dict[str, Any], raw: Any) -> PatchSpec | None:
        if raw is None:
            return None
        if data.get("stream"):
            raise PatchError(f"{PATCH_FIELD}: a streamed response cannot report a patch that failed; "
                             "use stream: false (or /v1/patch_sweep with stream: true)")
        if data.get("n", 1) != 1:
            raise PatchError(f"{PATCH_FIELD}: n > 1 is not supported with patch; send the prompt n times")
        if path == "/v1/chat/completions" and _has_media(data.get("messages")):
            raise PatchError(f"{PATCH_FIELD}: patching is text-only; the messages carry non-text content")
        frontend: InterpFrontend = state.vllm_interp_frontend
        generations = {}
        if frontend.patching and raw:
            generations = combined_generations(await state.engine_client.collective_rpc(SOURCES_RPC))
        return frontend.validate_patch(raw, generations.get)

    async def _results_for(self, scope: Scope, response: "_BufferedResponse",
                           prepared: PreparedRequest) -> tuple[dict[str, Any] | None, int | None]:
        """The body with the request's results, and a status replacing vLLM's (a failed patch); (None, None)
        when vLLM answered with an error."""
        body = response.json()
        if response.status != 200 or body is None:
            return None, None
        usage = body.get("usage") or {}
        length = int(usage.get("prompt_tokens", 0)) + int(usage.get("completion_tokens", 0))
        state = scope["app"].state
        frontend: InterpFrontend = state.vllm_interp_frontend
        collector = frontend.collector({prepared.key: length}, {prepared.key: prepared})
        await collect_results_async(
            collector, lambda pending, wait_s: state.engine_client.collective_rpc(RESULTS_RPC, args=(pending, wait_s)))
        results = frontend.merged(collector)[prepared.key]
        patch = results.pop(PATCH_RESULT, None)
        if patch is not None and patch.status != "ok":
            return error_body(f"{PATCH_FIELD}: {patch.message}", param=PATCH_FIELD, code=409), 409
        if results:
            body["capture_results"] = {
                name: result_to_json(result, frontend.consumers[name].result_to_json)
                for name, result in results.items()
            }
        return body, None


def _has_media(messages: Any) -> bool:
    """Whether chat messages carry content parts other than text (images, audio, ...)."""
    for message in messages or []:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") != "text" for p in content):
            return True
    return False


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

    async def replay(self, send: Send, body: dict[str, Any] | None, status: int | None = None) -> None:
        content = b"".join(self.chunks) if body is None else json.dumps(body).encode()
        headers = [(k, v) for k, v in (self.start or {}).get("headers", []) if k.lower() != b"content-length"]
        await send({"type": "http.response.start", "status": status or self.status,
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
