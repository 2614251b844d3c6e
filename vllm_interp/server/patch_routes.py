"""Patching over HTTP: ``/v1/patch_sources`` (listing and deleting stored source runs, the twins of
``LLM.patch_sources`` and ``LLM.delete_patch_source``; deleting needs an API key when keys are configured,
like /v1/steering) and ``POST /v1/patch_sweep`` (a causal-tracing sweep, as one JSON response or as
server-sent events: ``start``, one ``cell`` per cell, ``summary``; a client that disconnects cancels the
cells left).

Run ids are keys of the workers' in-memory source stores (``vllm_interp.patching.sources``): no path is ever
made of one. The sweep body is read through ``vllm_interp.server.bodies``; ``--max-sweep-cells`` bounds it."""

import json
import logging
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sse_starlette import EventSourceResponse

from vllm_interp.frontend import SOURCES_RPC, InterpFrontend, combined_generations, merged_sources
from vllm_interp.patching.spec import PatchError
from vllm_interp.patching.sweep import SweepRunner, parse_sweep_request, plan_sweep
from vllm_interp.server.auth import require_key
from vllm_interp.server.bodies import BodyError, limits_of, request_json
from vllm_interp.server.protocol import error_body
from vllm_interp.server.request_fields import field_error_response

logger = logging.getLogger(__name__)
router = APIRouter(prefix="/v1/patch_sources")
sweep_router = APIRouter()


def _disabled() -> JSONResponse:
    return JSONResponse(error_body("patching is not enabled on this engine (--enable-patching)"), 400)


@router.get("")
async def list_sources(request: Request) -> Any:
    if not request.app.state.vllm_interp_frontend.patching:
        return _disabled()
    runs = merged_sources(await request.app.state.engine_client.collective_rpc(SOURCES_RPC))
    return {"runs": [runs[run_id] for run_id in sorted(runs)]}


@router.delete("/{run_id:path}")
async def delete_source(request: Request, run_id: str) -> Any:
    require_key(request, request.app.state.vllm_interp_api_keys)
    if not request.app.state.vllm_interp_frontend.patching:
        return _disabled()
    held = await request.app.state.engine_client.collective_rpc("interp_delete_patch_source", args=(run_id,))
    if not any(held):
        return JSONResponse(error_body(f"run_id: no source run {run_id!r}", param="run_id", code=404), 404)
    return {"deleted": run_id}


@sweep_router.post("/v1/patch_sweep")
async def patch_sweep(request: Request) -> Any:
    state = request.app.state
    frontend: InterpFrontend = state.vllm_interp_frontend
    engine = state.engine_client
    if not frontend.patching:
        return _disabled()
    try:
        body = parse_sweep_request(await request_json(request))
        source_positions = None
        if body.source_run is not None:
            held = [rank.get(body.source_run) for rank in await engine.collective_rpc(SOURCES_RPC)]
            if not any(held):
                raise PatchError(f"source_run: unknown source run {body.source_run!r}")
            source_positions = next(info for info in held if info)["positions"]
        plan = plan_sweep(body, tokenizer=engine.get_tokenizer(), num_layers=frontend.steering.shape.num_layers,
                          vocab=engine.model_config.get_vocab_size(), max_cells=limits_of(state).max_sweep_cells,
                          max_model_len=engine.model_config.max_model_len, source_positions=source_positions)
    except BodyError as exc:
        return exc.response()
    except PatchError as exc:
        return field_error_response(exc)

    async def generations() -> dict[str, str]:
        return combined_generations(await engine.collective_rpc(SOURCES_RPC))

    async def delete(run_id: str) -> None:
        await engine.collective_rpc("interp_delete_patch_source", args=(run_id,))

    runner = SweepRunner(
        plan, frontend,
        generate=lambda tokens, params, request_id: engine.generate({"prompt_token_ids": tokens}, params, request_id),
        results=state.vllm_interp_results,
        run_generations=generations, delete_run=delete)
    if body.stream:
        async def events():
            try:
                async for kind, data in runner.events():
                    yield {"event": kind, "data": json.dumps(data)}
            except PatchError as exc:
                yield {"event": "error", "data": json.dumps(error_body(str(exc), param=str(exc).split(":", 1)[0]))}
            except Exception as exc:  # the stream has begun: say so in it rather than cut the connection
                logger.exception("patch sweep %s failed", runner.sweep_id)
                yield {"event": "error", "data": json.dumps(error_body(f"the sweep failed: {exc}", code=500))}
        return EventSourceResponse(events())
    summary = None
    try:
        async for kind, data in runner.events():
            if kind == "summary":
                summary = data
    except PatchError as exc:
        return field_error_response(exc)
    return summary
