"""Request bodies on vllm-interp's HTTP surface: read within a byte bound, parsed as JSON, never a 500.

The request-fields middleware and every route of ours parse bodies here, so a body that is not JSON, comes
with another content type, is nested deeper than ``MAX_JSON_DEPTH`` or is larger than
``--max-interp-body-bytes`` gets a 400 (413 for its size) whose ``param`` is ``body``. The depth bound keeps
every later step (pydantic, ``json.dumps`` of a rewritten body, vLLM's own parse of it) far below Python's
recursion limit, which a body of 100,000 nested lists would otherwise reach as a 500.
"""

import json
from typing import Any

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse

from vllm_interp.config import FrontendLimits
from vllm_interp.server.protocol import error_body

# Far deeper than any request of ours or of vLLM's (chat tools' JSON schemas included) needs.
MAX_JSON_DEPTH = 128
BODY_PARAM = "body"


class BodyError(Exception):
    """A body refused as a whole; ``status`` is 400, or 413 for its size."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(f"{BODY_PARAM}: {message}")
        self.status = status

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(str(self), param=BODY_PARAM, code=self.status), status_code=self.status)


def limits_of(state: Any) -> FrontendLimits:
    """The server's limits (``init_state`` sets them; an app state without them has the defaults)."""
    return getattr(state, "vllm_interp_limits", None) or FrontendLimits()


def too_large(limit: int) -> BodyError:
    return BodyError(f"larger than the {limit} bytes allowed (--max-interp-body-bytes)", status=413)


def check_content_type(content_type: str | None) -> None:
    """JSON only: no Content-Type (taken as JSON, as FastAPI does), ``application/json`` or
    ``application/*+json``, with any parameters."""
    if not content_type:
        return
    media = content_type.split(";", 1)[0].strip().lower()
    if media == "application/json" or (media.startswith("application/") and media.endswith("+json")):
        return
    raise BodyError(f"Content-Type must be application/json, got {media[:64]!r}")


def parse_json(body: bytes, content_type: str | None) -> Any:
    """The JSON value of ``body``, or a ``BodyError``."""
    check_content_type(content_type)
    try:
        value = _decoded(body)
    except RecursionError:
        raise BodyError(f"nested more than {MAX_JSON_DEPTH} levels deep") from None
    except ValueError:  # malformed JSON, bytes that are not UTF-8, an integer with too many digits
        raise BodyError("not valid JSON") from None
    if _deeper_than(value, MAX_JSON_DEPTH):
        raise BodyError(f"nested more than {MAX_JSON_DEPTH} levels deep")
    return value


def _decoded(body: bytes) -> Any:
    """``json.loads(body)``, through msgspec's decoder where it agrees (2.6x faster on a 177 KB steered request,
    all of it on the API server's one event loop). msgspec refuses what Python's json accepts (NaN, a number
    beyond float range, a lone surrogate) and nests no deeper than Python's recursion: those go to json.loads."""
    try:
        return msgspec.json.decode(body)
    except (msgspec.MsgspecError, RecursionError):
        return json.loads(body)


def _deeper_than(value: Any, limit: int) -> bool:
    """Whether arrays and objects nest more than ``limit`` levels (level by level: no recursion). A container
    holding none is passed over at C speed (``map(type)``): a prompt of token ids is no Python loop."""
    level, depth = ([value] if isinstance(value, dict | list) else []), 0
    while level:
        depth += 1
        if depth > limit:
            return True
        below = []
        for item in level:
            children = item.values() if isinstance(item, dict) else item
            if not _CONTAINERS.isdisjoint(map(type, children)):
                below += [child for child in children if isinstance(child, dict | list)]
        level = below
    return False


_CONTAINERS = frozenset((dict, list))  # the only containers a JSON decoder makes


async def request_json(request: Request) -> Any:
    """A route's JSON body (None when empty), refused without reading on to its end when it is over
    ``--max-interp-body-bytes`` (by its Content-Length, else as it arrives)."""
    limit = limits_of(request.app.state).max_interp_body_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large(limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large(limit)
    return parse_json(bytes(body), request.headers.get("content-type")) if body else None
