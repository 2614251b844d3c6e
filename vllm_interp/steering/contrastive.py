"""Contrastive steering vectors: mean(positive) - mean(negative) of the residual stream, in one call.

The request (``POST /v1/steering/vectors/contrastive`` and ``LLM.contrastive_vector``, same fields)::

    {"positive": [prompts], "negative": [prompts], "hook": "post_block", "layers": [ints] | "all",
     "positions": "last_prompt" | "mean_prompt", "normalize": false, "name": optional}

Prompts are raw text (no chat template), all captured in one batch through the ``inline`` consumer with one
generated token each. ``last_prompt`` takes each prompt's last position, ``mean_prompt`` the mean over its
positions; then each side is the mean over its prompts (every prompt weighs the same), and the vector of a
layer is positive minus negative, scaled to unit norm with ``normalize``. ``norms`` are the norms before
that scaling. With ``name`` the vectors are registered as named steering vectors (base tier).
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, field_validator

from vllm_interp.capture.consumers.inline import ResidualReadout
from vllm_interp.hooks import Hook, ModelShape, canonical_hook, site_name
from vllm_interp.steering.vectors import SteeringError, pack_vectors

CAPTURE_POSITIONS = {"last_prompt": "last_prompt", "mean_prompt": "all_prompt"}
CONSUMER = "inline"


class ContrastiveRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    positive: list[str] = Field(min_length=1)
    negative: list[str] = Field(min_length=1)
    hook: Hook = "post_block"
    layers: list[StrictInt] | Literal["all"]
    positions: Literal["last_prompt", "mean_prompt"] = "last_prompt"
    normalize: bool = False
    name: str | None = None

    @field_validator("hook", mode="before")
    @classmethod
    def _canonical_hook(cls, value: Any) -> Any:
        return canonical_hook(value) or value

    @field_validator("positive", "negative")
    @classmethod
    def _non_empty_prompts(cls, value: list[str]) -> list[str]:
        if any(not prompt for prompt in value):
            raise ValueError("prompts must not be empty strings")
        return value

    def capture_spec(self, num_layers: int) -> dict[str, Any]:
        """The inline capture every prompt runs with."""
        layers = list(range(num_layers)) if self.layers == "all" else self.layers
        return {CONSUMER: {"hooks": {self.hook: layers}, "positions": CAPTURE_POSITIONS[self.positions]}}

    @property
    def prompts(self) -> list[str]:
        return [*self.positive, *self.negative]


def validate_contrastive(raw: Any, *, shape: ModelShape, consumers: Sequence[str]) -> ContrastiveRequest:
    """The one validation of a contrastive request; ``SteeringError`` naming the field otherwise."""
    try:
        request = ContrastiveRequest.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first["loc"] if not (isinstance(p, str) and "[" in p)) or "body"
        raise SteeringError(f"{loc}: {first['msg'].removeprefix('Value error, ')}") from None
    if request.layers != "all":
        if not request.layers:
            raise SteeringError("layers: name at least one layer")
        if bad := [layer for layer in request.layers if not 0 <= layer < shape.num_layers]:
            raise SteeringError(f"layers: {bad} out of range [0, {shape.num_layers})")
        if len(set(request.layers)) != len(request.layers):
            raise SteeringError("layers: must not repeat entries")
    if request.name is not None and not request.name:
        raise SteeringError("name: must not be empty")
    if CONSUMER not in consumers:
        raise SteeringError(f"positive: contrastive vectors read the residual stream through the {CONSUMER} "
                            f"capture consumer; enable it (--capture-consumers {CONSUMER})")
    return request


@dataclass(frozen=True)
class ContrastiveVectors:
    hook: Hook
    layers: list[int]
    vectors: dict[int, np.ndarray]  # layer -> float32 [hidden]
    norms: dict[int, float]  # before normalisation
    name: str | None = None

    def steering_spec(self, scale: float = 1.0) -> dict[str, dict[int, list[float]]]:
        """``{hook: {layer: vector * scale}}``: a steering tier's spec."""
        return {self.hook: {layer: (vector * np.float32(scale)).tolist() for layer, vector in self.vectors.items()}}

    def to_json(self) -> dict[str, Any]:
        """The HTTP answer; ``vectors`` in the compact base64 form (float32)."""
        return {"name": self.name, "hook": self.hook, "layers": self.layers,
                "norms": {str(layer): norm for layer, norm in self.norms.items()},
                "vectors": pack_vectors(self.vectors)}


def contrastive_vectors(request: ContrastiveRequest, readouts: Sequence[ResidualReadout],
                        num_layers: int) -> ContrastiveVectors:
    """The vectors from every prompt's readout, in ``request.prompts`` order (positive, then negative)."""
    layers = list(range(num_layers)) if request.layers == "all" else sorted(request.layers)
    positive, negative = readouts[: len(request.positive)], readouts[len(request.positive):]
    vectors, norms = {}, {}
    for layer in layers:
        site = site_name(layer, request.hook)
        difference = _side_mean(positive, site) - _side_mean(negative, site)
        norms[layer] = float(np.linalg.norm(difference))
        if request.normalize:
            if norms[layer] == 0.0:
                raise SteeringError(f"normalize: layer {layer}'s difference is zero; it has no direction")
            difference = difference / np.float32(norms[layer])
        vectors[layer] = difference.astype(np.float32)
    return ContrastiveVectors(request.hook, layers, vectors, norms, request.name)


def _side_mean(readouts: Sequence[ResidualReadout], site: str) -> np.ndarray:
    """Mean over prompts of each prompt's mean over its captured positions (float64 while summing)."""
    per_prompt = [readout[site].double().mean(dim=0).numpy() for readout in readouts]
    return np.mean(per_prompt, axis=0)
