"""Read-out: the residual stream at chosen (layer, hook, positions) of a request, returned as tensors.

``ReadoutSpec`` is the wire format; ``validate_readout_spec`` is the one validation used by the offline API
and the worker. Positions are absolute token indices of the sequence (prompt then generated tokens); the
last generated token is never fed through the model, so it has no residual.
"""

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from vllm_interp.hooks import HOOKS, Hook, site_name

PositionKeyword = Literal["all", "all_prompt", "last_prompt", "all_generated"]


class ReadoutSpecError(ValueError):
    pass


class ReadoutSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    layers: list[int] | Literal["all"] = "all"
    hooks: list[Hook] | Literal["all"] = "all"
    positions: list[int] | PositionKeyword = "last_prompt"

    @field_validator("layers", "hooks", "positions")
    @classmethod
    def _non_empty_unique(cls, value: Any) -> Any:
        if isinstance(value, list):
            if not value:
                raise ValueError("must not be empty")
            if len(set(value)) != len(value):
                raise ValueError("must not repeat entries")
        return value

    @field_validator("positions")
    @classmethod
    def _non_negative(cls, value: Any) -> Any:
        if isinstance(value, list) and min(value) < 0:
            raise ValueError("positions are absolute token indices and must be >= 0")
        return value

    def resolved_layers(self, num_layers: int) -> list[int]:
        return list(range(num_layers)) if self.layers == "all" else sorted(self.layers)

    def resolved_hooks(self) -> list[str]:
        return list(HOOKS) if self.hooks == "all" else [h for h in HOOKS if h in self.hooks]

    def site_names(self, num_layers: int) -> list[str]:
        return [site_name(layer, hook) for layer in self.resolved_layers(num_layers) for hook in self.resolved_hooks()]

    def select(self, positions: np.ndarray, prompt_len: int) -> np.ndarray:
        """Boolean mask over ``positions``: which of them this spec reads."""
        match self.positions:
            case "all":
                return np.ones(positions.shape, dtype=bool)
            case "all_prompt":
                return positions < prompt_len
            case "last_prompt":
                return positions == prompt_len - 1
            case "all_generated":
                return positions >= prompt_len
            case explicit:
                return np.isin(positions, explicit)

    def expected_positions(self, prompt_len: int, num_computed: int) -> list[int]:
        """Positions that must have been read once ``num_computed`` tokens went through the model."""
        computed = np.arange(num_computed)
        return computed[self.select(computed, prompt_len)].tolist()


def validate_readout_spec(raw: Any, *, num_layers: int) -> ReadoutSpec:
    """Parse and check a read-out spec against the model; errors name the offending field."""
    if isinstance(raw, ReadoutSpec):
        spec = raw
    else:
        try:
            spec = ReadoutSpec.model_validate(raw)
        except ValidationError as exc:
            first = exc.errors()[0]
            field = ".".join(str(p) for p in first["loc"]) or "readout"
            raise ReadoutSpecError(f"readout.{field}: {first['msg']}") from None
    if spec.layers != "all":
        bad = [layer for layer in spec.layers if not 0 <= layer < num_layers]
        if bad:
            raise ReadoutSpecError(f"readout.layers: {bad} out of range for a model with {num_layers} layers")
    return spec


@dataclass
class ResidualReadout:
    """Residual rows of one request: ``readout["12.post_block"]`` is a ``[positions, hidden]`` tensor."""

    positions: list[int]
    tensors: dict[str, torch.Tensor]

    def __getitem__(self, site: str | tuple[int, str]) -> torch.Tensor:
        key = site_name(*site) if isinstance(site, tuple) else site
        if key not in self.tensors:
            raise KeyError(f"site {key!r} was not read; read sites: {list(self.tensors)}")
        return self.tensors[key]

    @property
    def sites(self) -> list[str]:
        return list(self.tensors)

    def stack(self, hook: str) -> torch.Tensor:
        """``[layers, positions, hidden]`` for one hook, in layer order."""
        names = [name for name in self.tensors if name.endswith(f".{hook}")]
        if not names:
            raise KeyError(f"hook {hook!r} was not read")
        return torch.stack([self.tensors[name] for name in names])

    @classmethod
    def from_wire(cls, payload: dict[str, Any]) -> "ResidualReadout":
        if payload.get("error"):
            raise ReadoutError(payload["error"])
        if not payload["sites"]:
            return cls(positions=list(payload["positions"]), tensors={})
        dtype = getattr(torch, payload["dtype"])
        shape = payload["shape"]  # [positions, sites, hidden]
        block = torch.frombuffer(bytearray(payload["data"]), dtype=torch.uint8).view(dtype).reshape(shape)
        tensors = {name: block[:, i].clone() for i, name in enumerate(payload["sites"])}
        return cls(positions=list(payload["positions"]), tensors=tensors)


class ReadoutError(RuntimeError):
    pass


def readout_to_wire(positions: list[int], sites: list[str], block: torch.Tensor) -> dict[str, Any]:
    """Plain (msgpack-safe) form of ``block`` = ``[positions, sites, hidden]``."""
    block = block.contiguous()
    return {
        "positions": positions,
        "sites": sites,
        "shape": list(block.shape),
        "dtype": str(block.dtype).removeprefix("torch."),
        "data": block.view(torch.uint8).numpy().tobytes(),
        "error": None,
    }


def merge_wire(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Merge one request's payloads from several ranks: pipeline stages each hold their own layers,
    tensor-parallel ranks hold the same rows (only rank 0 reports them)."""
    errors = [p["error"] for p in parts if p.get("error")]
    if errors:
        return {"error": "; ".join(errors)}
    with_sites = [p for p in parts if p["sites"]]
    if len(with_sites) <= 1:
        return (with_sites or parts)[0]
    readouts = [ResidualReadout.from_wire(p) for p in with_sites]
    positions = readouts[0].positions
    if any(r.positions != positions for r in readouts):
        return {"error": "pipeline stages read different positions"}
    tensors = {name: t for r in readouts for name, t in r.tensors.items()}
    sites = sorted(tensors, key=lambda n: (int(n.split(".")[0]), HOOKS.index(n.split(".")[1])))
    return readout_to_wire(positions, sites, torch.stack([tensors[n] for n in sites], dim=1))
