"""API keys for mutating endpoints: ``--steering-api-key`` (repeatable) or ``VLLM_INTERP_STEERING_API_KEY``
(comma-separated). Keys are compared in constant time; with no key configured the endpoints are open."""

import hmac
import os

from fastapi import HTTPException, Request

API_KEY_ENV = "VLLM_INTERP_STEERING_API_KEY"


def configured_keys(flag_values: list[str] | None) -> list[bytes]:
    keys = list(flag_values or [])
    keys += [k for k in os.environ.get(API_KEY_ENV, "").split(",") if k]
    return [k.encode() for k in keys]


def presented_key(request: Request) -> bytes:
    auth = request.headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip().encode()
    return request.headers.get("x-api-key", "").encode()


def require_key(request: Request, keys: list[bytes]) -> None:
    if not keys:
        return
    given = presented_key(request)
    # Compare against every key so the time taken does not depend on which one matched.
    matched = [hmac.compare_digest(given, key) for key in keys]
    if not any(matched):
        detail = "a valid steering API key is required (Authorization: Bearer KEY, or X-API-Key: KEY)"
        raise HTTPException(status_code=401, detail=detail)
