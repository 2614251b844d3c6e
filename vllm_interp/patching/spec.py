"""The patch spec: its wire form, its one validation, and the normalised form the engine carries.

A request's ``patch`` is a list of entries ``{layer, hook, position, alpha = 1.0, source}`` (or ``site``,
e.g. ``blocks.3.hook_resid_post``, for ``layer`` and ``hook``; hooks may be spelled as TransformerLens does): at
``(layer, hook)`` the residual row of prompt position ``position`` becomes ``(1 - alpha) * x + alpha *
source`` (alpha 1: the source exactly). ``source`` is exactly one of

- ``{"run": RUN_ID, "position": p}``: row ``p`` of the same site in a stored source run (``patch_source``);
- ``{"zeros": true}``: ablation;
- ``{"vector": V}``: a vector in the steering entry forms (a list of floats or ``{vector, scale}``).

``validate_patch`` is shared by the HTTP layer, the offline API and the sweep driver; its errors name the
field (``patch.2.source.run``). The normalised ``PatchSpec`` travels in ``extra_args`` (``to_wire``) with
a digest that keys the prefix cache from the lowest patched position on.
"""

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pybase64

from vllm_interp.hooks import HOOK_SPELLINGS, ModelShape, canonical_hook, parse_site_name
from vllm_interp.request_args import MAX_TOKEN_POSITION
from vllm_interp.site_vectors import check_site_vector, entry_vector

FIELD = "patch"


class PatchError(ValueError):
    """A patch spec the engine cannot apply; the message starts with the offending field."""


@dataclass(frozen=True)
class PatchEntry:
    layer: int
    hook: str
    position: int
    alpha: float
    # Exactly one source: a vector (zeros included) or a row of a stored run.
    vector: np.ndarray | None = None
    run: str | None = None
    run_position: int | None = None


@dataclass(frozen=True)
class PatchSpec:
    entries: tuple[PatchEntry, ...]
    # run id -> the stored run's generation (unique per capture), so a re-captured run never shares KV.
    run_generations: Mapping[str, str]

    @property
    def first_position(self) -> int:
        return min(entry.position for entry in self.entries)

    @property
    def runs(self) -> list[str]:
        return sorted({entry.run for entry in self.entries if entry.run is not None})

    def digest(self) -> str:
        """Identifies what the patched positions hold: identical specs share prefix-cache blocks."""
        h = hashlib.sha256()
        for entry in self.entries:
            h.update(f"{entry.layer}/{entry.hook}/{entry.position}/{entry.alpha!r}".encode())
            if entry.vector is not None:
                h.update(np.ascontiguousarray(entry.vector, dtype="<f4").tobytes())
            else:
                h.update(f"run/{entry.run}/{self.run_generations[entry.run]}/{entry.run_position}".encode())
        return h.hexdigest()[:32]

    def to_wire(self) -> dict[str, Any]:
        """msgpack-plain form for ``extra_args`` (vectors as base64 float32)."""
        entries = []
        for e in self.entries:
            wire: dict[str, Any] = {"layer": e.layer, "hook": e.hook, "position": e.position, "alpha": e.alpha}
            if e.vector is not None:
                wire["vector"] = pybase64.b64encode_as_string(e.vector.astype("<f4").tobytes())
            else:
                wire["run"], wire["run_position"] = e.run, e.run_position
            entries.append(wire)
        return {"entries": entries, "runs": dict(self.run_generations), "digest": self.digest()}

    @classmethod
    def from_wire(cls, wire: Mapping[str, Any]) -> "PatchSpec":
        entries = []
        for e in wire["entries"]:
            vector = np.frombuffer(pybase64.b64decode(e["vector"]), dtype="<f4") if "vector" in e else None
            entries.append(PatchEntry(e["layer"], e["hook"], e["position"], e["alpha"], vector, e.get("run"),
                                      e.get("run_position")))
        return cls(tuple(entries), dict(wire.get("runs") or {}))


def _integer(raw: Any, where: str, *, low: int = 0, high: int | None = None) -> int:
    if not isinstance(raw, int) or isinstance(raw, bool):
        raise PatchError(f"{where}: expected an integer")
    if raw < low or (high is not None and raw >= high):
        bound = f"[{low}, {high})" if high is not None else f">= {low}"
        raise PatchError(f"{where}: {raw} out of range {bound}")
    return raw


def _source(raw: Any, where: str, shape: ModelShape, run_generation: Callable[[str], str | None]
            ) -> tuple[np.ndarray | None, str | None, int | None, str | None]:
    """(vector, run, run position, run generation) of one entry's source."""
    if not isinstance(raw, Mapping):
        raise PatchError(f"{where}: expected an object with one of run, zeros, vector")
    kinds = [kind for kind in ("run", "zeros", "vector") if kind in raw]
    if len(kinds) != 1:
        raise PatchError(f"{where}: exactly one of run, zeros, vector (got {', '.join(kinds) or 'none'})")
    kind = kinds[0]
    allowed = {"run", "position"} if kind == "run" else {kind}
    if extra := sorted(set(raw) - allowed):
        raise PatchError(f"{where}.{extra[0]}: not a field of a {kind} source")
    if kind == "zeros":
        if raw["zeros"] is not True:
            raise PatchError(f"{where}.zeros: must be true")
        return np.zeros(shape.hidden_size, dtype=np.float32), None, None, None
    if kind == "vector":
        vector = entry_vector(raw["vector"], f"{where}.vector", PatchError)
        check_site_vector(vector, f"{where}.vector", shape.hidden_size, PatchError)
        return vector.astype(np.float32), None, None, None
    run = raw["run"]
    if not isinstance(run, str) or not run:
        raise PatchError(f"{where}.run: expected a run id (a non-empty string)")
    if "position" not in raw:
        raise PatchError(f"{where}.position: required with a run source")
    position = _integer(raw["position"], f"{where}.position", high=MAX_TOKEN_POSITION)
    generation = run_generation(run)
    if generation is None:
        raise PatchError(f"{where}.run: unknown source run {run!r} (GET /v1/patch_sources lists them)")
    return None, run, position, generation


def _site(item: Mapping[str, Any], where: str, shape: ModelShape) -> tuple[int, str]:
    """(layer, hook) of an entry: ``layer`` and ``hook`` (either spelling), or one ``site`` name."""
    if "site" in item:
        if "layer" in item or "hook" in item:
            raise PatchError(f"{where}.site: give site, or layer and hook, not both")
        try:
            layer, hook = parse_site_name(item["site"])
        except (ValueError, TypeError, AttributeError):
            raise PatchError(f"{where}.site: {item['site']!r} is not a site name ('12.post_block' or "
                             "'blocks.12.hook_resid_post')") from None
        _integer(layer, f"{where}.site", high=shape.num_layers)
        return layer, hook
    for required in ("layer", "hook"):
        if required not in item:
            raise PatchError(f"{where}.{required}: required (or give site)")
    layer = _integer(item["layer"], f"{where}.layer", high=shape.num_layers)
    hook = canonical_hook(item["hook"])
    if hook is None:
        raise PatchError(f"{where}.hook: unknown hook {item['hook']!r} (known: {', '.join(HOOK_SPELLINGS)})")
    return layer, hook


def validate_patch(raw: Any, *, shape: ModelShape, enabled: bool, max_patches: int,
                   run_generation: Callable[[str], str | None]) -> PatchSpec | None:
    """The one validation of a request's ``patch`` field (None or empty: no patch).

    ``run_generation(run_id)`` gives a stored run's generation, or None when no such run is stored;
    ``max_patches`` is the engine's ``--max-patch-rows`` (a step must hold all of a request's patches).
    """
    if raw is None or raw == []:
        return None
    if not enabled:
        raise PatchError(f"{FIELD}: patching is not enabled on this engine (--enable-patching)")
    if not isinstance(raw, list):
        raise PatchError(f"{FIELD}: expected a list of {{layer, hook, position, alpha, source}} entries")
    if len(raw) > max_patches:
        raise PatchError(f"{FIELD}: {len(raw)} entries, more than this engine's --max-patch-rows ({max_patches})")
    entries, seen, generations = [], set(), {}
    for i, item in enumerate(raw):
        where = f"{FIELD}.{i}"
        if not isinstance(item, Mapping):
            raise PatchError(f"{where}: expected an object {{layer, hook, position, alpha, source}}")
        for required in ("position", "source"):
            if required not in item:
                raise PatchError(f"{where}.{required}: required")
        if extra := sorted(set(item) - {"layer", "hook", "site", "position", "alpha", "source"}):
            raise PatchError(f"{where}.{extra[0]}: unknown field")
        layer, hook = _site(item, where, shape)
        position = _integer(item["position"], f"{where}.position", high=MAX_TOKEN_POSITION)
        alpha = item.get("alpha", 1.0)
        if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not 0.0 <= alpha <= 1.0:
            raise PatchError(f"{where}.alpha: expected a number in [0, 1]")
        if (layer, hook, position) in seen:
            raise PatchError(f"{where}: layer {layer} {hook} position {position} is patched twice")
        seen.add((layer, hook, position))
        vector, run, run_position, generation = _source(item["source"], f"{where}.source", shape, run_generation)
        if run is not None:
            generations[run] = generation
        entries.append(PatchEntry(layer, hook, position, float(alpha), vector, run, run_position))
    return PatchSpec(tuple(entries), generations)
