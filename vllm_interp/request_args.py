"""The per-request payload vllm-interp carries in ``SamplingParams.extra_args``.

Everything lives under one key so that it never collides with other users of ``extra_args`` and stays
msgpack-plain on its way from the frontend to the workers. Over HTTP the middleware hands the payload to the
request's handler in ``HTTP_PAYLOAD`` (see ``engine/v0_26/openai_params.py``); a JSON string under the key is
still understood.
"""

import json
from contextvars import ContextVar
from typing import Any

EXTRA_ARGS_KEY = "vllm_interp"
# Token positions a spec may name: beyond any sequence vLLM serves, and small enough for msgpack's 64-bit
# integers on the way to the engine (a larger one would fail in transport, after admission).
MAX_TOKEN_POSITION = 2**31
# msgpack, which carries the payload to the engine, holds integers in [-2**63, 2**64).
_WIRE_INTS = range(-(2**63), 2**64)


def oversized_integer(value: Any, path: str = "") -> str | None:
    """The path (``a.b.0``) of the first integer in ``value`` that msgpack cannot carry, or None."""
    if isinstance(value, int) and not isinstance(value, bool):
        return None if value in _WIRE_INTS else path
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if (found := oversized_integer(item, f"{path}.{key}" if path else str(key))) is not None:
            return found
    return None


# The payload the HTTP middleware prepared for the request whose handler runs in this context (None: none).
HTTP_PAYLOAD: ContextVar[dict[str, Any] | None] = ContextVar("vllm_interp_http_payload", default=None)


def interp_args(extra_args: dict[str, Any] | None) -> dict[str, Any]:
    value = (extra_args or {}).get(EXTRA_ARGS_KEY) or {}
    if isinstance(value, str):
        # Parsed once per process: the scheduler and the block hasher ask on every step and block.
        value = json.loads(value)
        extra_args[EXTRA_ARGS_KEY] = value
    return value


def with_interp_args(extra_args: dict[str, Any] | None, **fields: Any) -> dict[str, Any]:
    merged = dict(extra_args or {})
    merged[EXTRA_ARGS_KEY] = {**interp_args(extra_args), **fields}
    return merged
