"""API keys for vllm-interp's mutating endpoints (docs/limits.md lists them): ``--steering-api-key``
(repeatable) or ``VLLM_INTERP_STEERING_API_KEY`` (comma-separated). A key is presented as
``Authorization: Bearer KEY`` or ``X-API-Key: KEY``; either header may carry it, so a server that also has
vLLM's ``--api-key`` (which takes the Authorization header) still accepts ours in X-API-Key. Keys are
compared in constant time; with no key configured the endpoints are open."""

import hmac
import os

from fastapi import HTTPException, Request

API_KEY_ENV = "VLLM_INTERP_STEERING_API_KEY"


def configured_keys(flag_values: list[str] | None) -> list[bytes]:
    keys = list(flag_values or [])
    keys += [k for k in os.environ.get(API_KEY_ENV, "").split(",") if k]
    return [k.encode() for k in keys]


def presented_keys(request: Request) -> list[bytes]:
    """The keys a request presents: its bearer token and its X-API-Key (each may be absent)."""
    auth = request.headers.get("authorization", "")
    bearer = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
    return [given.encode() for given in (bearer, request.headers.get("x-api-key", "")) if given]


def require_key(request: Request, keys: list[bytes]) -> None:
    if not keys:
        return
    # Compare every presented key with every configured one, so the time taken does not depend on which matched.
    matched = [hmac.compare_digest(given, key) for given in presented_keys(request) for key in keys]
    if not any(matched):
        detail = "a valid steering API key is required (Authorization: Bearer KEY, or X-API-Key: KEY)"
        raise HTTPException(status_code=401, detail=detail)
