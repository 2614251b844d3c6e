"""Frontend side of steering: the global tiers, the named vectors, and a request's fields validated into its
own vectors (``vllm_interp.frontend`` puts them in the payload the engine core and the workers read).

One instance lives in the process that admits requests (the offline ``LLM`` or the API server). A global
change is validated here (``plan_set``/``plan_clear``), pushed to every worker by the caller with
``collective_rpc("interp_set_global_steering")`` and only then committed, so this state never claims
vectors the workers do not have.
"""

from collections.abc import Mapping
from typing import Any

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


class SteeringState:
    def __init__(self, shape: ModelShape, *, enabled: bool,
                 saes: Mapping[str, SparseAutoencoder] | None = None) -> None:
        self.shape = shape
        self.enabled = enabled
        # Steering entries may name a feature of these (``{sae, feature, scale}``).
        self.saes = dict(saes or {})
        self.global_vectors = SteeringVectors()
        self.named: dict[str, SteeringVectors] = {}

    def _validate(self, tiers: Mapping[Tier, Any], fields: Mapping[Tier, str]) -> SteeringVectors:
        return validate_steering(tiers, shape=self.shape, enabled=self.enabled, fields=fields, saes=self.saes)

    # -- global --------------------------------------------------------------------------------------
    def plan_set(self, spec: Mapping[str, Any], *, replace: bool = False) -> SteeringVectors:
        """The global vectors after a set: ``spec`` has ``vectors``, ``prefill_vectors``,
        ``decode_vectors``; without ``replace`` the given sites overwrite the current ones, the rest stay."""
        if not self.enabled:
            raise SteeringError("vectors: steering is not enabled on this engine (--enable-steering)")
        update = self._validate({tier: spec.get(name) for tier, name in GLOBAL_FIELDS.items()}, GLOBAL_FIELDS)
        return update if replace else self.global_vectors.merged(update)

    def plan_clear(self) -> SteeringVectors:
        if not self.enabled:
            raise SteeringError("vectors: steering is not enabled on this engine (--enable-steering)")
        return SteeringVectors()

    def commit(self, vectors: SteeringVectors) -> None:
        self.global_vectors = vectors

    # -- named ---------------------------------------------------------------------------------------
    def register(self, name: str, spec: Mapping[str, Any]) -> SteeringVectors:
        if not name:
            raise SteeringError("name: must not be empty")
        vectors = self._validate({tier: spec.get(field) for tier, field in GLOBAL_FIELDS.items()}, GLOBAL_FIELDS)
        if vectors.is_empty:
            raise SteeringError("vectors: a named entry needs at least one vector")
        self.named[name] = vectors
        return vectors

    def unregister(self, name: str) -> None:
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
            if name not in self.named:
                known = ", ".join(sorted(self.named)) or "none"
                raise SteeringError(f"{NAME_FIELD}: unknown name {name!r} (registered: {known})")
            vectors = vectors + self.named[name]
        return vectors

    def describe(self) -> dict[str, Any]:
        return {GLOBAL_FIELDS[tier]: self.global_vectors.to_json().get(tier, {}) for tier in TIERS}
