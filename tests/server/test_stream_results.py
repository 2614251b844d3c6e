"""Streamed capture results in the HTTP middleware, against a scripted vLLM (no engine): the results ride on
the last event however vLLM's body is split into messages, events reach the client as they come, the usage
chunk asked for on the client's behalf never reaches it, and error statuses and error events pass untouched."""

import asyncio
import json
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch
from starlette.datastructures import State

from vllm_interp.capture.consumers.logging import STATS, LoggingConsumer
from vllm_interp.capture.packed import pack
from vllm_interp.frontend import InterpFrontend, ResultsPoller
from vllm_interp.hooks import ModelShape
from vllm_interp.request_args import HTTP_PAYLOAD
from vllm_interp.server.request_fields import RequestFieldsMiddleware
from vllm_interp.steering.state import SteeringState

USAGE = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
# The logging consumer's result as a worker sends it (statistics packed), and as the client receives it.
WIRE_RESULT = {"status": "ok", "message": None, "rows": 1, "dropped": 0, "spilled": 0,
               "result": {"rows": 1, "sites": ["1.post_block"], "stats": pack(torch.ones(1, 1, len(STATS))),
                          "format": "lists"}}
RESULT = {**WIRE_RESULT, "result": {"rows": 1, "stats": {"1.post_block": {key: [1.0] for key in STATS}}}}
REQUEST = {"prompt": "x", "max_tokens": 2, "stream": True,
           "capture": {"logging": {"hooks": {"post_block": [1]}, "positions": "all"}}}
DONE = b"data: [DONE]\n\n"


def _event(chunk: dict) -> bytes:
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def vllm_events(request: dict) -> list[bytes]:
    """What vLLM streams for a two-token completion: the system fingerprint rides on the usage chunk when
    there is one, else on the chunk that finishes the choice."""
    first = {"id": "cmpl-1", "choices": [{"index": 0, "text": " Par", "finish_reason": None}]}
    last = {"id": "cmpl-1", "choices": [{"index": 0, "text": "is", "finish_reason": "length"}]}
    if (request.get("stream_options") or {}).get("include_usage"):
        tail = [last, {"id": "cmpl-1", "choices": [], "usage": USAGE, "system_fingerprint": "fp"}]
    else:
        tail = [{**last, "system_fingerprint": "fp"}]
    return [_event(chunk) for chunk in [first, *tail]] + [DONE]


def error_events(request: dict) -> list[bytes]:
    return [vllm_events(request)[0], _event({"error": {"message": "boom", "code": 500}}), DONE]


def whole(events: list[bytes]) -> list[bytes]:
    return [b"".join(events)]


def by_event(events: list[bytes]) -> list[bytes]:
    return events


def five_bytes(events: list[bytes]) -> list[bytes]:
    data = b"".join(events)
    return [data[i:i + 5] for i in range(0, len(data), 5)]


class Engine:
    """The workers' results RPC: every key asked for has the logging consumer's result."""

    def __init__(self) -> None:
        self.asked: list[dict[str, int | None]] = []
        self.sent = 0  # vLLM's body messages so far
        self.asked_after: list[int] = []  # how many had been sent at each ask

    async def collective_rpc(self, method: str, args: tuple) -> list[dict]:
        pending, _wait_s = args
        self.asked.append(dict(pending))
        self.asked_after.append(self.sent)
        return [{key: {"logging": WIRE_RESULT} for key in pending}]


def _serve(request: dict, events: Callable[[dict], list[bytes]] = vllm_events,
           split: Callable[[list[bytes]], list[bytes]] = by_event, status: int = 200, gap_s: float = 0.0,
           global_capture: bool = False) -> SimpleNamespace:
    """Send ``request`` through the middleware to a vLLM that answers ``status`` and ``events(its request)``,
    split into body messages by ``split``, ``gap_s`` apart. Returns the request vLLM got, what the client got (in
    all and after each of vLLM's messages) and the engine."""
    state = State()
    state.vllm_interp_frontend = InterpFrontend(SteeringState(ModelShape(4, 8), enabled=False),
                                                {"logging": LoggingConsumer}, patching=False, max_patch_rows=8,
                                                global_capture=global_capture)
    state.engine_client = Engine()
    state.vllm_interp_results = ResultsPoller.for_engine(state.engine_client)
    run = SimpleNamespace(request=None, payload=None, status=None, body=[], after_message=[],
                          engine=state.engine_client)

    async def vllm(scope, receive, send):
        run.request = json.loads((await receive())["body"])
        run.payload = HTTP_PAYLOAD.get()  # what vLLM's request objects put into extra_args
        await send({"type": "http.response.start", "status": status, "headers": []})
        for piece in split(events(run.request)):
            await send({"type": "http.response.body", "body": piece, "more_body": True})
            run.engine.sent += 1
            run.after_message.append(b"".join(run.body))
            await asyncio.sleep(gap_s)
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def receive():
        return {"type": "http.request", "body": json.dumps(request).encode(), "more_body": False}

    async def client(message):
        if message["type"] == "http.response.start":
            run.status = message["status"]
        else:
            run.body.append(message["body"])

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [],
             "app": SimpleNamespace(state=state)}
    asyncio.run(RequestFieldsMiddleware(vllm)(scope, receive, client))
    run.body = b"".join(run.body)
    return run


def _chunks(body: bytes) -> list[dict | str]:
    events = body.decode().split("\n\n")
    assert events[-1] == "" and all(e.startswith("data: ") for e in events[:-1]), body
    return [e[6:] if e == "data: [DONE]" else json.loads(e[6:]) for e in events[:-1]]


@pytest.mark.parametrize("split", [whole, by_event, five_bytes])
@pytest.mark.parametrize("stream_options", [None, {"include_usage": True},
                                            {"include_usage": False, "continuous_usage_stats": True}])
def test_results_ride_on_the_last_event(split, stream_options):
    client_request = {**REQUEST, "stream_options": stream_options}
    run = _serve(client_request, split=split)
    assert run.status == 200
    client_usage = bool((stream_options or {}).get("include_usage"))
    expected_options = stream_options if client_usage else {**(stream_options or {}), "include_usage": True,
                                                             "continuous_usage_stats": False}
    assert run.request["stream_options"] == expected_options
    ((key, length),) = run.engine.asked[0].items()
    assert length == USAGE["prompt_tokens"] + USAGE["completion_tokens"]
    assert run.payload["capture_key"] == key and "vllm_xargs" not in run.request
    # The client sees what vLLM sends for its own request, the last event before [DONE] with the results.
    plain = _chunks(b"".join(vllm_events(client_request)))
    assert _chunks(run.body) == [*plain[:-2], {**plain[-2], "capture_results": {"logging": RESULT}}, "[DONE]"]


def test_events_reach_the_client_as_they_come():
    run = _serve(REQUEST)
    first = vllm_events(run.request)[0]
    # Only the chunk that finishes the choice waits (for [DONE]); the usage chunk is never sent.
    assert run.after_message[:3] == [first, first, first]
    assert run.body.startswith(first) and run.body.endswith(DONE) and b'"usage"' not in run.body


@pytest.mark.parametrize("split", [whole, by_event, five_bytes])
def test_an_error_event_passes_through_untouched(split):
    run = _serve(REQUEST, events=error_events, split=split)
    assert run.body == b"".join(error_events(run.request)) and run.engine.asked == []


def test_an_error_status_passes_through_untouched():
    def rejected(request: dict) -> list[bytes]:
        return [b'{"error": {"message": "bad", "code": 400}}']

    run = _serve(REQUEST, events=rejected, status=400)
    assert run.status == 400 and run.body == rejected(run.request)[0] and run.engine.asked == []


def test_token_chunks_as_vllm_writes_them_pass_unparsed_and_the_rest_is_parsed():
    """vLLM writes chunks with pydantic (compact JSON): plain token chunks are told from their bytes; a finishing
    chunk, the usage chunk, an error event and text that quotes the markers are not taken for one."""
    from vllm.entrypoints.openai.completion.protocol import CompletionResponseStreamChoice, CompletionStreamResponse
    from vllm.entrypoints.openai.engine.protocol import UsageInfo

    from vllm_interp.server.request_fields import _plainly_a_token

    def event(text: str, finish_reason: str | None = None, usage: UsageInfo | None = None, choices=True) -> bytes:
        choice = CompletionResponseStreamChoice(index=0, text=text, logprobs=None, finish_reason=finish_reason,
                                                stop_reason=None)
        chunk = CompletionStreamResponse(id="cmpl-1", created=0, model="m", choices=[choice] if choices else [],
                                         usage=usage)
        return b"data: " + chunk.model_dump_json(exclude_unset=True).encode()

    assert _plainly_a_token(event(" Paris"))
    assert _plainly_a_token(event('"finish_reason":"stop" "usage":{ "error"'))  # quoted in text: escaped
    assert not _plainly_a_token(event("is", finish_reason="length"))
    assert not _plainly_a_token(event("", usage=UsageInfo(prompt_tokens=3, completion_tokens=2, total_tokens=5),
                                      choices=False))
    assert not _plainly_a_token(b'data: {"error": {"message": "boom"}}')


PROMPT_ONLY = {**REQUEST, "capture": {"logging": {"hooks": {"post_block": [1]}}}}  # last_prompt, the default


def test_results_whole_at_prefill_are_asked_for_at_the_first_event():
    """A stream capturing only its prompt asks for its results while it generates (without a length, which ends
    nothing), once, and they ride on its last event as ever."""
    run = _serve(PROMPT_ONLY, gap_s=0.05)
    ((key, length),) = run.engine.asked[0].items()
    assert run.engine.asked == [{key: None}] and run.engine.asked_after == [1]
    plain = _chunks(b"".join(vllm_events(PROMPT_ONLY)))
    assert _chunks(run.body) == [*plain[:-2], {**plain[-2], "capture_results": {"logging": RESULT}}, "[DONE]"]


@pytest.mark.parametrize("request_body, global_capture", [(REQUEST, False), (PROMPT_ONLY, True)])
def test_other_streams_ask_at_their_end_with_their_length(request_body, global_capture):
    """Generated positions, or a global capture the workers add to every request: results come at the end."""
    run = _serve(request_body, gap_s=0.05, global_capture=global_capture)
    assert [list(asked.values()) for asked in run.engine.asked] == [[7]]
    assert run.engine.asked_after == [len(vllm_events(run.request)) - 1]  # while [DONE] is passed on


def test_an_error_after_an_early_ask_passes_through_untouched():
    run = _serve(PROMPT_ONLY, events=error_events, gap_s=0.05)
    assert run.body == b"".join(error_events(run.request))

