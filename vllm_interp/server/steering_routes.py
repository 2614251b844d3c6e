"""/v1/steering/*: global steering, named vectors and contrastive vectors over HTTP (the twins of
vllm_interp.LLM's methods).

Every mutating endpoint (set, clear, vectors/register, vectors/unregister, vectors/contrastive with ``name``)
checks the API key before anything else it can; bodies are read through ``vllm_interp.server.bodies``. Changes
run through ``SharedSteering.change`` and reads start with its ``refresh``, so that with several API servers
(``--api-server-count N``) every server answers with the same vectors."""

import asyncio
from typing import Any
from uuid import uuid4

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from vllm import SamplingParams

from vllm_interp.capture.consumers.inline import ResidualReadout
from vllm_interp.capture.spec import CaptureSpecError
from vllm_interp.frontend import InterpFrontend
from vllm_interp.hooks import HOOKS
from vllm_interp.request_args import EXTRA_ARGS_KEY
from vllm_interp.server.auth import require_key
from vllm_interp.server.bodies import BodyError, request_json
from vllm_interp.server.protocol import (
    SteeringClearRequest,
    SteeringRegisterRequest,
    SteeringSetRequest,
    SteeringUnregisterRequest,
    error_body,
)
from vllm_interp.server.request_fields import check_capture_size, field_error_response
from vllm_interp.server.shared_steering import SharedSteering
from vllm_interp.steering.contrastive import ContrastiveRequest, contrastive_vectors, validate_contrastive
from vllm_interp.steering.state import SteeringState
from vllm_interp.steering.vectors import SteeringError, SteeringVectors

router = APIRouter(prefix="/v1/steering")


def _shared(request: Request) -> SharedSteering:
    return request.app.state.vllm_interp_shared_steering


def _state(request: Request) -> SteeringState:
    """This server's steering state, with every API server's changes so far."""
    shared = _shared(request)
    shared.refresh()
    return shared.state


async def _body(request: Request, model: type[BaseModel]) -> BaseModel:
    """The body as ``model``; an empty body only where the model has no fields."""
    raw = await request_json(request)
    if raw is None and not model.model_fields:
        raw = {}
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(map(str, first["loc"])) or "body"
        message = "expected a JSON object, got an empty body" if raw is None else first["msg"]
        raise _BadRequest(JSONResponse(error_body(f"{param}: {message}", param=param), 400)) from None


class _BadRequest(Exception):
    def __init__(self, response: JSONResponse) -> None:
        self.response = response


async def _mutating(request: Request, model: type[BaseModel], action) -> Any:
    """Shared shape of every mutating endpoint: key check, body validation, action, errors as 400."""
    require_key(request, request.app.state.vllm_interp_api_keys)
    try:
        body = await _body(request, model)
        return await _shared(request).change(lambda: action(body))
    except BodyError as exc:
        return exc.response()
    except _BadRequest as exc:
        return exc.response
    except SteeringError as exc:
        return field_error_response(exc)


async def _push_global(request: Request, vectors: SteeringVectors) -> dict[str, Any]:
    # collective_rpc shares the queue with execute_model: every worker has the vectors before the next step.
    await request.app.state.engine_client.collective_rpc("interp_set_global_steering", args=(vectors.to_wire(),))
    state = _state(request)
    state.commit(vectors)
    return state.describe()


@router.get("")
async def get_steering(request: Request) -> dict[str, Any]:
    return _state(request).describe()


@router.get("/layers")
async def steerable_layers(request: Request) -> dict[str, Any]:
    state = _state(request)
    layers = state.shape.num_layers
    return {"enabled": state.enabled, "num_layers": layers, "layers": list(range(layers)), "hooks": list(HOOKS),
            "hidden_size": state.shape.hidden_size}


@router.post("/set")
async def set_steering(request: Request) -> Any:
    async def action(body: SteeringSetRequest):
        return await _push_global(request, _state(request).plan_set(body.model_dump(), replace=body.replace))

    return await _mutating(request, SteeringSetRequest, action)


@router.post("/clear")
async def clear_steering(request: Request) -> Any:
    async def action(_body):
        return await _push_global(request, _state(request).plan_clear())

    return await _mutating(request, SteeringClearRequest, action)


@router.get("/vectors")
async def list_vectors(request: Request) -> dict[str, Any]:
    return {"names": sorted(_state(request).named)}


@router.post("/vectors/register")
async def register_vectors(request: Request) -> Any:
    async def action(body: SteeringRegisterRequest):
        _state(request).register(body.name, body.model_dump())
        return {"registered": body.name}

    return await _mutating(request, SteeringRegisterRequest, action)


@router.post("/vectors/unregister")
async def unregister_vectors(request: Request) -> Any:
    async def action(body: SteeringUnregisterRequest):
        _state(request).unregister(body.name)
        return {"unregistered": body.name}

    return await _mutating(request, SteeringUnregisterRequest, action)


@router.post("/vectors/contrastive")
async def contrastive_vector(request: Request) -> Any:
    """mean(positive) - mean(negative) residuals (``vllm_interp.steering.contrastive``); registering the
    result under ``name`` needs an API key, like /vectors/register."""
    state = request.app.state
    frontend: InterpFrontend = state.vllm_interp_frontend
    try:
        raw = await request_json(request)
    except BodyError as exc:
        return exc.response()
    if isinstance(raw, dict) and raw.get("name") is not None:
        require_key(request, state.vllm_interp_api_keys)
    try:
        body = validate_contrastive(raw, shape=frontend.steering.shape, consumers=list(frontend.consumers))
        if body.name is not None:
            _state(request).check_room(body.name)  # before the prompts run, not after
        result = contrastive_vectors(body, await _readouts(state, body), frontend.steering.shape.num_layers)
        if body.name is not None:
            async def register() -> None:
                _state(request).register(body.name, {"vectors": result.steering_spec()})

            await _shared(request).change(register)
    except (SteeringError, CaptureSpecError) as exc:
        return field_error_response(exc)
    return result.to_json()


async def _readouts(state: Any, body: ContrastiveRequest) -> list[ResidualReadout]:
    """Every prompt's captured rows, all prompts submitted at once (one batch)."""
    frontend: InterpFrontend = state.vllm_interp_frontend
    engine = state.engine_client
    spec = frontend.validate_capture(body.capture_spec(frontend.steering.shape.num_layers))
    tokenizer, max_model_len = engine.get_tokenizer(), engine.model_config.max_model_len
    for side in ("positive", "negative"):
        for i, prompt in enumerate(getattr(body, side)):
            if (count := len(tokenizer.encode(prompt))) >= max_model_len:  # each prompt generates one token
                raise SteeringError(f"{side}.{i}: {count} tokens; this model takes at most {max_model_len - 1} "
                                    "(--max-model-len)")
            check_capture_size(state, spec, prompt, max_tokens=1, field=f"{side}.{i}")
    prepared = [frontend.prepare({}, spec, None, collect=True) for _ in body.prompts]
    batch = uuid4().hex[:12]

    async def run(i: int, prompt: str):
        params = SamplingParams(temperature=0.0, max_tokens=1, extra_args={EXTRA_ARGS_KEY: prepared[i].payload})
        final = None
        async for output in engine.generate(prompt, params, f"contrastive-{batch}-{i}"):
            final = output
        return final

    outputs = await asyncio.gather(*(run(i, prompt) for i, prompt in enumerate(body.prompts)))
    lengths = {p.key: len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for p, o in zip(prepared, outputs,
                                                                                         strict=True)}
    collector = frontend.collector(lengths, {p.key: p for p in prepared})
    await state.vllm_interp_results.collect(collector)
    results = frontend.merged(collector)
    readouts = []
    for i, p in enumerate(prepared):
        inline = results[p.key]["inline"]
        if inline.status != "ok" or inline.result is None:
            raise SteeringError(f"positive: capturing prompt {i} failed: {inline.message}")
        readouts.append(ResidualReadout.from_result(inline.result))
    return readouts
