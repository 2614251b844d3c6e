"""One site's vector as a request gives it, shared by the specs that take vectors (steering entries, patch
``vector`` sources): a JSON list of numbers or ``{"vector": [...], "scale": s}``, as float32, and the check that
it fits a site (the model's width, finite values). Each caller names its own error class, so a bad vector is a
``SteeringError`` in a steering spec and a ``PatchError`` in a patch, each naming the field."""

from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, ValidationError

FLOAT32_MAX = float(np.finfo(np.float32).max)  # a Python float: compares with any int without overflow
_NOT_NUMBERS = frozenset((bool, str))  # what numpy would take for a number and JSON does not


class ScaledVector(BaseModel):
    # Strict: a numeric string or a boolean is an error, not a number (an integer is fine).
    model_config = ConfigDict(extra="forbid", strict=True)

    vector: list[float]
    scale: float = 1.0


def entry_vector(raw: Any, where: str, error: type[ValueError]) -> np.ndarray:
    """``raw`` as a float32 vector (scale applied), or ``error`` naming ``where`` and what is wrong."""
    if (array := _float_list(raw)) is not None:
        return array
    if isinstance(raw, dict) and set(raw) <= {"vector", "scale"}:
        array, scale = _float_list(raw.get("vector")), raw.get("scale", 1.0)
        if array is not None and isinstance(scale, float | int) and not isinstance(scale, bool) \
                and abs(scale) <= FLOAT32_MAX:
            return array * np.float32(scale)
    try:
        if isinstance(raw, dict):
            entry = ScaledVector.model_validate(raw)
            return np.asarray(entry.vector, dtype=np.float32) * np.float32(entry.scale)
        return np.asarray(ScaledVector(vector=raw).vector, dtype=np.float32)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first["loc"] if p != "vector")
        raise error(f"{where}{'.' + loc if loc else ''}: {first['msg']}") from None


def check_site_vector(vector: np.ndarray, where: str, hidden_size: int, error: type[ValueError]) -> None:
    """Raise ``error`` naming ``where`` unless ``vector`` holds ``hidden_size`` finite values."""
    if vector.shape != (hidden_size,):
        raise error(f"{where}: expected {hidden_size} values, got {vector.size}")
    if not np.isfinite(vector).all():
        raise error(f"{where}: values must be finite (got NaN or infinity)")


def _float_list(raw: Any) -> np.ndarray | None:
    """A JSON list of numbers as float32, or None if it is not one (numpy parses it far faster than
    pydantic, which then only explains what is wrong; the item types are looked at in C, ``map(type)``)."""
    if not isinstance(raw, list) or not _NOT_NUMBERS.isdisjoint(map(type, raw)):
        return None
    try:
        array = np.asarray(raw, dtype=np.float32)
    except (TypeError, ValueError, OverflowError):  # an integer beyond any float: pydantic names it
        return None
    return array if array.ndim == 1 else None
