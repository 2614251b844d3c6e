"""Pydantic models of the vllm-interp HTTP wire formats (bodies of /v1/steering/*, request fields)."""

from typing import Any

from pydantic import BaseModel, ConfigDict


class SteeringSetRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    vectors: dict[str, Any] | None = None
    prefill_vectors: dict[str, Any] | None = None
    decode_vectors: dict[str, Any] | None = None
    replace: bool = False


class SteeringClearRequest(BaseModel):
    """``/v1/steering/clear`` takes no fields: an empty body or ``{}``."""

    model_config = ConfigDict(extra="forbid")


class SteeringRegisterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    vectors: dict[str, Any] | None = None
    prefill_vectors: dict[str, Any] | None = None
    decode_vectors: dict[str, Any] | None = None


class SteeringUnregisterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str


class InterpRequestFields(BaseModel):
    """The top-level fields vllm-interp adds to /v1/completions and /v1/chat/completions (their contents
    are checked by the steering and capture validators)."""

    model_config = ConfigDict(extra="ignore")

    steering_vectors: dict[str, Any] | None = None
    prefill_steering_vectors: dict[str, Any] | None = None
    decode_steering_vectors: dict[str, Any] | None = None
    steering_name: str | None = None
    capture: dict[str, Any] | None = None
    patch: list[Any] | None = None


STEERING_FIELDS = ("steering_vectors", "prefill_steering_vectors", "decode_steering_vectors", "steering_name")


def error_body(message: str, param: str | None = None, code: int = 400) -> dict[str, Any]:
    """The OpenAI error shape vLLM itself answers with."""
    kinds = {400: "BadRequestError", 401: "Unauthorized", 404: "NotFoundError", 409: "ConflictError",
             413: "RequestEntityTooLargeError"}
    return {"error": {"message": message, "type": kinds.get(code, "Error"), "param": param, "code": code}}
