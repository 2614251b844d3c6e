"""Frontend side of steering: the global tiers, the named vectors, and a request's fields validated into its
own vectors (``vllm_interp.frontend`` puts them in the payload the engine core and the workers read).

One instance lives in the process that admits requests (the offline ``LLM`` or the API server). A global
change is validated here (``plan_set``/``plan_clear``), pushed to every worker by the caller with
``collective_rpc("interp_set_global_steering")`` and only then committed, so this state never claims
vectors the workers do not have.

Bounds (``FrontendLimits``): site vectors in one spec (a request's own plus its named vectors, a named entry,
the global vectors after a set), the number of named entries, and the syntax of their names.
"""

import re
from collections.abc import Mapping
from typing import Any

from vllm_interp.config import FrontendLimits
from vllm_interp.sae import SparseAutoencoder
from vllm_interp.steering.vectors import (
    REQUEST_FIELDS,
    TIERS,
    ModelShape,
    SteeringError,
    SteeringVectors,
    Tier,
    validate_steering,
)

GLOBAL_FIELDS: dict[Tier, str] = {"base": "vectors", "prefill": "prefill_vectors", "decode": "decode_vectors"}
NAME_FIELD = "steering_name"
# Raw request fields as offline callers put them in extra_args (see steered_params).
RAW_KEY = "steering_request"
# Names are keys, never paths, but are held to a file-safe identifier anyway: nothing can turn one into a path
# later, and a name is short enough to echo in an error.
VECTOR_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,63}")


def check_vector_name(name: Any, field: str) -> None:
    """Raise a ``SteeringError`` naming ``field`` unless ``name`` is a valid named-vector name."""
    if isinstance(name, str) and VECTOR_NAME.fullmatch(name) and ".." not in name:
        return
    shown = repr(name) if len(repr(name)) <= 40 else repr(name)[:37] + "..."
    raise SteeringError(f"{field}: {shown} is not a vector name: 1 to 64 letters, digits, '_', '-', '.', starting "
                        "with a letter, digit or '_', without '..'")


class SteeringState:
    def __init__(self, shape: ModelShape, *, enabled: bool,
                 saes: Mapping[str, SparseAutoencoder] | None = None, limits: FrontendLimits | None = None) -> None:
        self.shape = shape
        self.enabled = enabled
        self.limits = limits or FrontendLimits()
        # Steering entries may name a feature of these (``{sae, feature, scale}``).
        self.saes = dict(saes or {})
        self.global_vectors = SteeringVectors()
        self.named: dict[str, SteeringVectors] = {}

    def _validate(self, tiers: Mapping[Tier, Any], fields: Mapping[Tier, str]) -> SteeringVectors:
        return validate_steering(tiers, shape=self.shape, enabled=self.enabled, fields=fields, saes=self.saes)

    def _bounded(self, vectors: SteeringVectors, fields: Mapping[Tier, str], what: str) -> SteeringVectors:
        """``vectors`` if they hold at most ``max_steering_sites_per_request`` site vectors; the error names the
        field of the tier holding most."""
        counts = {tier: len(vectors.tiers.get(tier, {})) for tier in TIERS}
        limit = self.limits.max_steering_sites_per_request
        if sum(counts.values()) > limit:
            field = fields[max(counts, key=counts.__getitem__)]
            raise SteeringError(f"{field}: {sum(counts.values())} site vectors in {what} (all tiers), more than the "
                                f"{limit} allowed (--max-steering-sites-per-request)")
        return vectors

    # -- global --------------------------------------------------------------------------------------
    def plan_set(self, spec: Mapping[str, Any], *, replace: bool = False) -> SteeringVectors:
        """The global vectors after a set: ``spec`` has ``vectors``, ``prefill_vectors``,
        ``decode_vectors``; without ``replace`` the given sites overwrite the current ones, the rest stay."""
        if not self.enabled:
            raise SteeringError("vectors: steering is not enabled on this engine (--enable-steering)")
        update = self._validate({tier: spec.get(name) for tier, name in GLOBAL_FIELDS.items()}, GLOBAL_FIELDS)
        return self._bounded(update if replace else self.global_vectors.merged(update), GLOBAL_FIELDS,
                             "the global vectors")

    def plan_clear(self) -> SteeringVectors:
        if not self.enabled:
            raise SteeringError("vectors: steering is not enabled on this engine (--enable-steering)")
        return SteeringVectors()

    def commit(self, vectors: SteeringVectors) -> None:
        self.global_vectors = vectors

    # -- named ---------------------------------------------------------------------------------------
    def register(self, name: str, spec: Mapping[str, Any]) -> SteeringVectors:
        """Register (or replace) ``name``; raises ``SteeringError`` naming the field at fault."""
        self.check_room(name)
        vectors = self._validate({tier: spec.get(field) for tier, field in GLOBAL_FIELDS.items()}, GLOBAL_FIELDS)
        if vectors.is_empty:
            raise SteeringError("vectors: a named entry needs at least one vector")
        self.named[name] = self._bounded(vectors, GLOBAL_FIELDS, "a named entry")
        return vectors

    def check_room(self, name: Any, field: str = "name") -> None:
        """Raise a ``SteeringError`` unless ``name`` can be registered: a valid name, registered already (a
        replacement) or within ``max_named_vectors``. Callers that compute vectors check it before the work."""
        check_vector_name(name, field)
        limit = self.limits.max_named_vectors
        if name not in self.named and len(self.named) >= limit:
            raise SteeringError(f"{field}: {len(self.named)} named entries are registered, the most allowed "
                                "(--max-named-vectors); unregister one first")

    def unregister(self, name: str) -> None:
        check_vector_name(name, "name")
        if name not in self.named:
            raise SteeringError(f"name: no steering vectors are registered as {name!r}")
        del self.named[name]

    # -- requests ------------------------------------------------------------------------------------
    def request_vectors(self, fields: Mapping[str, Any]) -> SteeringVectors:
        """Validate a request's steering fields (``steering_vectors``, ``prefill_steering_vectors``,
        ``decode_steering_vectors``, ``steering_name``) into its own vectors."""
        vectors = self._validate({tier: fields.get(field) for tier, field in REQUEST_FIELDS.items()}, REQUEST_FIELDS)
        name = fields.get(NAME_FIELD)
        if name is not None:
            if not self.enabled:
                raise SteeringError(f"{NAME_FIELD}: steering is not enabled on this engine (--enable-steering)")
            check_vector_name(name, NAME_FIELD)
            if name not in self.named:
                known = ", ".join(sorted(self.named)) or "none"
                raise SteeringError(f"{NAME_FIELD}: unknown name {name!r} (registered: {known})")
            vectors = vectors + self.named[name]
        return self._bounded(vectors, REQUEST_FIELDS, "this request's own and named vectors")

    def describe(self) -> dict[str, Any]:
        return {GLOBAL_FIELDS[tier]: self.global_vectors.to_json().get(tier, {}) for tier in TIERS}
