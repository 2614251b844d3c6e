"""ASGI middleware: vllm-interp's top-level fields on /v1/completions and /v1/chat/completions.

vLLM ignores unknown top-level fields, so the fields are taken out of the JSON body here, validated (a bad
spec is answered with 400 naming the field, before vLLM sees the request), and replaced by the normalised
payload (``vllm_interp.frontend``), which the request's handler puts into ``SamplingParams.extra_args``
(``request_args.HTTP_PAYLOAD``, set around the handler; ``engine/v0_26/openai_params.py``). A client's own
``vllm_xargs["vllm_interp"]`` is refused: it would skip validation. Requests are stamped even without
fields of their own while global steering is set, so that their prefix-cache keys cover the global vectors.

A request with ``capture`` or ``patch`` gets a key; once vLLM's response is complete, the results for that
key are fetched from the workers: the consumers' go into the JSON body as ``capture_results``; a patch that
could not be applied as specified turns the response into a 409 error (the completion is not a patched
result). A streamed response cannot turn into an error once it has begun, so ``patch`` needs
``stream: false``.

A streamed response carries ``capture_results`` in its last event before ``data: [DONE]``. The results
need the request's final length, which only vLLM's usage chunk tells, so vLLM is asked for that chunk;
when the client did not ask for it, it is taken out again (its ``system_fingerprint`` going to the chunk
that finished the choice, where vLLM puts it without usage) and the results ride on the finishing chunk.
Events pass through as they come, except one that may be the last (see ``_ResultStream``). A stream whose
results are whole once its prompt has run (``PreparedRequest.results_at_prefill``: ``last_prompt`` or
``all_prompt`` captures) asks for them at its first event, so its last token does not wait for them.

Every body on these paths is parsed by ``vllm_interp.server.bodies`` (a body that is not JSON, or nested too
deeply, is a 400 naming ``body``, never a 500); one that carries our fields is held to
``--max-interp-body-bytes`` (413), and a capture to ``--max-capture-bytes-per-request``
(``vllm_interp.capture.limits``).
"""

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

import msgspec
from pydantic import ValidationError
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from vllm_interp.capture.limits import check_capture_bytes
from vllm_interp.capture.results import ConsumerResult, ResultCollector, result_to_json
from vllm_interp.capture.spec import CaptureSpec, CaptureSpecError
from vllm_interp.frontend import (
    SOURCES_RPC,
    InterpFrontend,
    PreparedRequest,
    combined_generations,
)
from vllm_interp.patching.spec import FIELD as PATCH_FIELD
from vllm_interp.patching.spec import PatchError, PatchSpec
from vllm_interp.patching.tables import PATCH_RESULT
from vllm_interp.request_args import EXTRA_ARGS_KEY, HTTP_PAYLOAD
from vllm_interp.server.bodies import BodyError, limits_of, parse_json, too_large
from vllm_interp.server.metrics import RESULTS_PREPARE, RESULTS_WAIT
from vllm_interp.server.protocol import STEERING_FIELDS, InterpRequestFields, error_body
from vllm_interp.steering.vectors import SteeringError

GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
# Our own routes read their bodies themselves.
OWN_PREFIXES = ("/v1/steering", "/v1/patch_sweep", "/v1/patch_sources")
FIELDS = tuple(InterpRequestFields.model_fields)
EVENT_END = b"\n\n"
DONE_EVENT = b"data: [DONE]"


def field_error_response(exc: ValueError) -> JSONResponse:
    """400 for a SteeringError/CaptureSpecError, whose message starts with the field's path."""
    message = str(exc)
    return JSONResponse(error_body(message, param=message.split(":", 1)[0]), status_code=400)


def _bad_request(param: str, message: str) -> JSONResponse:
    return JSONResponse(error_body(f"{param}: {message}", param=param), status_code=400)


@dataclass(frozen=True)
class _Rewritten:
    """The body vLLM gets and what the response needs: results to collect (``prepared.key``), whether they
    go into an event stream, and whether that stream's usage chunk is ours rather than the client's."""

    body: bytes
    prepared: PreparedRequest | None = None
    stream: bool = False
    strip_usage: bool = False


class RequestFieldsMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        if scope["path"] not in GENERATION_PATHS:
            await self._elsewhere(scope, receive, send)
            return
        body = await _read_body(receive)
        rewritten = await self._rewrite(scope, body)
        if isinstance(rewritten, JSONResponse):
            await rewritten(scope, receive, send)
            return
        prepared = rewritten.prepared
        app_scope = _with_length(scope, len(rewritten.body))
        app_receive = _replay(rewritten.body, receive)
        token = HTTP_PAYLOAD.set(prepared.payload if prepared is not None and prepared.payload else None)
        try:
            await self._handle(scope, app_scope, app_receive, send, rewritten)
        finally:
            HTTP_PAYLOAD.reset(token)

    async def _handle(self, scope: Scope, app_scope: Scope, app_receive: Receive, send: Send,
                      rewritten: "_Rewritten") -> None:
        prepared = rewritten.prepared
        if prepared is None or prepared.key is None:
            await self.app(app_scope, app_receive, send)
        elif rewritten.stream:
            stream = _ResultStream(send, scope["app"].state, prepared, rewritten.strip_usage)
            try:
                await self.app(app_scope, app_receive, stream.send)
            finally:
                stream.close()
        else:
            response = _BufferedResponse()
            await self.app(app_scope, app_receive, response.send)
            await response.replay(send, *await self._results_for(scope, response, prepared))

    async def _elsewhere(self, scope: Scope, receive: Receive, send: Send) -> None:
        """vLLM's other JSON endpoints (``/v1/chat/completions/batch``, ``/v1/responses``, ...) would ignore our
        fields: a body carrying one is refused, naming it, rather than served unsteered or uncaptured."""
        content_type = (_header(scope, b"content-type") or "application/json").split(";", 1)[0].strip().lower()
        if scope["path"].startswith(OWN_PREFIXES) or content_type != "application/json":
            await self.app(scope, receive, send)
            return
        body = await _read_body(receive)
        try:
            data = parse_json(body, content_type)
        except BodyError:
            data = None  # vLLM answers for its own endpoint
        if body.strip() and not isinstance(data, dict):  # vLLM's own validators fail on some with a 500
            await _bad_request("body", "expected a JSON object")(scope, receive, send)
            return
        ours = sorted(set(data) & set(FIELDS)) if isinstance(data, dict) else []
        xargs = data.get("vllm_xargs") if isinstance(data, dict) else None
        if isinstance(xargs, dict) and EXTRA_ARGS_KEY in xargs:
            ours = [f"vllm_xargs.{EXTRA_ARGS_KEY}"]
        if ours:
            await _bad_request(ours[0], f"vllm-interp fields are taken on {' and '.join(sorted(GENERATION_PATHS))} "
                               f"only, not on {scope['path']}")(scope, receive, send)
            return
        await self.app(_with_length(scope, len(body)), _replay(body, receive), send)

    async def _rewrite(self, scope: Scope, body: bytes) -> _Rewritten | JSONResponse:
        state = scope["app"].state
        frontend: InterpFrontend | None = getattr(state, "vllm_interp_frontend", None)
        try:
            data = parse_json(body, _header(scope, b"content-type"))
        except BodyError as exc:
            return exc.response()
        if not isinstance(data, dict):
            return _bad_request("body", "expected a JSON object")
        if frontend is None:
            return _Rewritten(body)
        xargs = data.get("vllm_xargs")
        if isinstance(xargs, dict) and EXTRA_ARGS_KEY in xargs:
            # Only this middleware writes the normalised payload; a client-made one would skip validation.
            return _bad_request(f"vllm_xargs.{EXTRA_ARGS_KEY}", "reserved for vllm-interp; use its request fields")
        fields = {name: data.pop(name) for name in FIELDS if name in data}
        max_bytes = limits_of(state).max_interp_body_bytes
        if fields and len(body) > max_bytes:
            return too_large(max_bytes).response()
        try:
            InterpRequestFields.model_validate(fields)
            capture = self._capture_spec(state, data, fields.get("capture"))
            patch = await self._patch_spec(state, scope["path"], data, fields.get(PATCH_FIELD))
            steering_fields = {k: v for k, v in fields.items() if k in STEERING_FIELDS}
            prepared = frontend.prepare(steering_fields, capture, patch, collect=True)
        except (SteeringError, CaptureSpecError, PatchError) as exc:
            return field_error_response(exc)
        except ValidationError as exc:  # a field of the wrong JSON type
            first = exc.errors()[0]
            return _bad_request(".".join(map(str, first["loc"])), first["msg"])
        if not fields and not prepared.payload:
            return _Rewritten(body)
        stream = bool(data.get("stream"))
        strip_usage = stream and prepared.key is not None and _ask_for_usage(state, data)
        # Re-encoded only when our fields come out or usage is asked for: the payload travels beside the body.
        rebuilt = json.dumps(data).encode() if fields or strip_usage else body
        return _Rewritten(rebuilt, prepared, stream, strip_usage)

    @staticmethod
    def _capture_spec(state: Any, data: dict[str, Any], raw: Any):
        if raw is None:
            return None
        spec = state.vllm_interp_frontend.validate_capture(raw)
        if data.get("n", 1) != 1:
            raise CaptureSpecError("capture: n > 1 is not supported with capture; send the prompt n times")
        if _several_prompts(data):
            raise CaptureSpecError("capture: one prompt per request with capture (results are per request); "
                                   "send the prompts as separate requests")
        check_capture_size(state, spec, data.get("prompt"), _max_tokens(data))
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
        if _several_prompts(data):
            raise PatchError(f"{PATCH_FIELD}: one prompt per request with patch; send the prompts as separate requests")
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
        capture, patch = await _collect(scope["app"].state, prepared, body.get("usage") or {})
        if patch is not None and patch.status != "ok":
            return error_body(f"{PATCH_FIELD}: {patch.message}", param=PATCH_FIELD, code=409), 409
        if capture:
            body["capture_results"] = capture
        return body, None


def _ask_for_usage(state: Any, data: dict[str, Any]) -> bool:
    """Have vLLM end the stream with its usage chunk; whether the client would not have got that chunk."""
    options = data.get("stream_options")
    server_args = getattr(state, "args", None)
    if getattr(server_args, "enable_force_include_usage", False) or not isinstance(options, dict | None):
        return False  # vLLM sends usage anyway, or refuses the options
    if (options or {}).get("include_usage"):
        return False
    # Without include_usage vLLM ignores continuous_usage_stats: turned off, the other chunks stay as they were.
    data["stream_options"] = {**(options or {}), "include_usage": True, "continuous_usage_stats": False}
    return True


_EarlyAsk = tuple[ResultCollector, asyncio.Future]  # the collector of an ask made early, and its polling


def _ask_early(state: Any, prepared: PreparedRequest) -> _EarlyAsk:
    """Ask the workers for the request's results while it still runs (``PreparedRequest.results_at_prefill``):
    the ask carries no length, which ends nothing, and is polled patiently until ``_collect`` needs it."""
    collector = state.vllm_interp_frontend.collector({prepared.key: None}, {prepared.key: prepared})
    return collector, asyncio.ensure_future(state.vllm_interp_results.collect(collector, patient=True))


async def _collect(state: Any, prepared: PreparedRequest, usage: dict[str, Any], early: _EarlyAsk | None = None,
                   ) -> tuple[dict[str, Any], ConsumerResult | None]:
    """The request's capture results as JSON (by consumer) and its patch status, from the workers; ``usage``
    (vLLM's token counts) gives the request's final length; ``early``: its results asked for already."""
    frontend: InterpFrontend = state.vllm_interp_frontend
    started = time.monotonic()
    collector = None
    if early is not None:
        collector, waiting = early
        state.vllm_interp_results.hurry(collector)
        await waiting
    if collector is None or collector.pending:  # not asked for early, or that ask ran out of time
        length = int(usage.get("prompt_tokens", 0)) + int(usage.get("completion_tokens", 0))
        collector = frontend.collector({prepared.key: length}, {prepared.key: prepared})
        await state.vllm_interp_results.collect(collector)
    collected = time.monotonic()
    results = frontend.merged(collector)[prepared.key]
    patch = results.pop(PATCH_RESULT, None)
    capture = {name: result_to_json(result, frontend.consumers[name].result_to_json)
               for name, result in results.items()}
    RESULTS_WAIT.observe(collected - started)
    RESULTS_PREPARE.observe(time.monotonic() - collected)
    return capture, patch


def check_capture_size(state: Any, spec: CaptureSpec, prompt: Any, max_tokens: int | None,
                       field: str = "capture") -> None:
    """``--max-capture-bytes-per-request`` for one request: the sequence is bounded by max_model_len,
    ``max_tokens`` and the prompt's length when it is known, a token-id prompt's, or a text prompt's once
    tokenized. Without a prompt (chat) the prompt counts as max_model_len tokens: its template is vLLM's."""
    max_model_len = getattr(state, "vllm_interp_max_model_len", None)
    if max_model_len is None:
        return  # an app state init_state did not set up has no model to bound the sequence by
    shape = state.vllm_interp_frontend.steering.shape
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    token_ids = _token_ids(prompt)

    def count_prompt() -> int:
        return len(state.engine_client.get_tokenizer().encode(prompt))

    check_capture_bytes(spec, consumers=state.vllm_interp_frontend.consumers, num_layers=shape.num_layers,
                        hidden_size=shape.hidden_size, max_tokens=max_tokens,
                        max_model_len=max_model_len, limit=limits_of(state).max_capture_bytes_per_request,
                        prompt_len=len(prompt) if token_ids else None,
                        count_prompt=count_prompt if isinstance(prompt, str) else None, field=field)


def _max_tokens(data: dict[str, Any]) -> int | None:
    """The most tokens the body lets vLLM generate, when it says (the larger of its two spellings)."""
    given = [v for v in (data.get("max_tokens"), data.get("max_completion_tokens"))
             if isinstance(v, int) and not isinstance(v, bool) and v >= 0]
    return max(given, default=None)


def _several_prompts(data: dict[str, Any]) -> bool:
    """A /v1/completions batch: a list of prompts (text or token lists), not one token list."""
    prompt = data.get("prompt")
    return isinstance(prompt, list) and len(prompt) > 1 and not _token_ids(prompt)


def _token_ids(prompt: Any) -> bool:
    """Whether a prompt is one list of token ids (JSON integers), told at C speed (``map(type)``): a 512-token
    prompt checked item by item in Python costs 30 us, twice per capturing request, on the one event loop."""
    return isinstance(prompt, list) and _JSON_INTEGERS.issuperset(map(type, prompt))


_JSON_INTEGERS = frozenset((int, bool))  # what isinstance(value, int) accepts of what a JSON decoder makes


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
        content = b"".join(self.chunks) if body is None else _json(body)
        headers = [(k, v) for k, v in (self.start or {}).get("headers", []) if k.lower() != b"content-length"]
        await send({"type": "http.response.start", "status": status or self.status,
                    "headers": [*headers, (b"content-length", str(len(content)).encode())]})
        await send({"type": "http.response.body", "body": content, "more_body": False})


class _ResultStream:
    """Passes vLLM's server-sent events on as they come, but holds back an event that may be the last one (a
    chunk that finishes a choice, or the usage chunk) until the next event shows whether it was; at
    ``[DONE]`` the held event takes the capture results. Holding only those keeps every token's timing.

    vLLM writes each event as ``data: <json>`` followed by a blank line; a body message may carry several
    events or part of one. An error status or an error event turns the rest of the stream into a plain
    pass-through."""

    def __init__(self, send: Send, state: Any, prepared: PreparedRequest, strip_usage: bool) -> None:
        self._send = send
        self._state = state
        self._prepared = prepared
        self._strip_usage = strip_usage
        self._partial = b""  # the start of an event whose end has not come yet
        self._held: tuple[bytes, dict[str, Any]] | None = None  # (as sent, as parsed)
        self._usage: dict[str, Any] | None = None
        self._pass_through = False
        # Results whole once the prompt has run are asked for at the first event (which comes after the
        # prompt's step): by the last token they are here, and the last token is not held while they come.
        self._early: _EarlyAsk | None = None

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self._pass_through = message["status"] != 200
        if message["type"] != "http.response.body" or self._pass_through:
            await self._send(message)
            return
        if self._early is None and self._prepared.results_at_prefill:
            self._early = _ask_early(self._state, self._prepared)
        body = message.get("body", b"")
        if not self._partial and self._held is None and message.get("more_body", False) and _one_token(body):
            await self._send(message)  # vLLM's usual message, one token's whole event: passed on as it came
            return
        data, out = self._partial + body, []
        while not self._pass_through and (end := data.find(EVENT_END)) >= 0:
            out.append(await self._on_event(data[:end]))
            data = data[end + len(EVENT_END):]
        more = message.get("more_body", False)
        if self._pass_through or not more:
            # After an error event nothing is held back; a stream that ended without [DONE] (not vLLM's way)
            # gets what is left as it is.
            out += [self._release(), data]
            data = b""
        self._partial = data
        if any(out) or not more:
            await self._send({"type": "http.response.body", "body": b"".join(out), "more_body": more})

    async def _on_event(self, event: bytes) -> bytes:
        """What to send on for one event (given without its blank line)."""
        if event == DONE_EVENT:
            return await self._finish() + event + EVENT_END
        if _plainly_a_token(event):
            return self._release() + event + EVENT_END
        chunk = _event_json(event)
        usage = chunk.get("usage") if chunk.get("choices") == [] else None
        if usage is not None:
            self._usage = usage
            if self._strip_usage:
                self._move_fingerprint(chunk)
                return b""
        released = self._release()
        if "error" in chunk:
            self._pass_through = True
        elif usage is not None or _finishes_a_choice(chunk):
            self._held = (event + EVENT_END, chunk)
            return released
        return released + event + EVENT_END

    def _move_fingerprint(self, usage_chunk: dict[str, Any]) -> None:
        """Without include_usage vLLM stamps the system fingerprint on the finishing chunk instead."""
        fingerprint = usage_chunk.get("system_fingerprint")
        if self._held is not None and fingerprint is not None:
            chunk = {**self._held[1], "system_fingerprint": fingerprint}
            self._held = (_event_bytes(chunk), chunk)

    async def _finish(self) -> bytes:
        if self._held is None or self._usage is None:
            return self._release()
        (sent, chunk), self._held = self._held, None
        # A streamed request carries no patch (refused up front), so there is no patch status to report.
        capture, _ = await _collect(self._state, self._prepared, self._usage, self._early)
        return _event_bytes({**chunk, "capture_results": capture}) if capture else sent

    def close(self) -> None:
        """The stream is over: results asked for early and not taken (an error, a client gone) are let go."""
        if self._early is not None:  # a no-op for an ask that is answered
            self._early[1].cancel()

    def _release(self) -> bytes:
        held, self._held = self._held, None
        return held[0] if held else b""


def _one_token(body: bytes) -> bool:
    """Whether a body message is exactly one event, ``_plainly_a_token``."""
    return body.find(EVENT_END) == len(body) - len(EVENT_END) and _plainly_a_token(body)


def _plainly_a_token(event: bytes) -> bool:
    """Whether an event is a chunk that neither finishes its choice nor carries usage or an error, told from
    its bytes: every event of a capturing stream passes here, and parsing each one on the API server's event
    loop would cost every stream it serves. (Generated text cannot fake these markers: its quotes are escaped.)
    Anything else is parsed."""
    return b'"finish_reason":null' in event and b'"usage":{' not in event and b'"error"' not in event


def _event_json(event: bytes) -> dict[str, Any]:
    """The JSON object of a ``data:`` event; empty for anything else."""
    if not event.startswith(b"data: "):
        return {}
    try:
        data = json.loads(event[len(b"data: "):])
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def _finishes_a_choice(chunk: dict[str, Any]) -> bool:
    choices = chunk.get("choices")
    return isinstance(choices, list) and any(isinstance(c, dict) and c.get("finish_reason") for c in choices)


def _json(value: Any) -> bytes:
    """A response body or event that carries capture results as JSON. Every-token statistics make a result of
    tens of thousands of floats per request, which ``json.dumps`` encodes on the API server's event loop at
    about 14 ms a request (845 KB); msgspec (a vLLM dependency) takes a tenth of that. NaN and infinities
    become ``null`` (``json.dumps`` writes ``NaN``, which is not JSON)."""
    return msgspec.json.encode(value)


def _event_bytes(chunk: dict[str, Any]) -> bytes:
    return b"data: " + _json(chunk) + EVENT_END


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


def _header(scope: Scope, name: bytes) -> str | None:
    value = next((v for k, v in scope["headers"] if k.lower() == name), None)
    return value.decode("latin-1") if value is not None else None


def _with_length(scope: Scope, length: int) -> Scope:
    headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
    return {**scope, "headers": [*headers, (b"content-length", str(length).encode())]}
