"""Steering vectors: the wire formats, their one validation, and the normalised form every layer uses.

A steering spec maps hook -> layer -> entry, where an entry is a list of floats, ``{vector, scale}`` or an
SAE feature ``{sae, feature, scale}`` (``scale * W_dec[feature]`` of an SAE loaded with ``--sae`` that reads
that site); instead of a layer map a hook may carry the compact form ``{dtype, shape, layers, data}`` (base64
of little-endian float32 or bfloat16, ``shape = [len(layers), hidden]``, optional ``scales``). Hooks may be
spelled as TransformerLens does (``hook_resid_post``), and a whole site name (``12.post_block``,
``blocks.12.hook_resid_post``) may map directly to one entry. Three tiers:
``base`` (every token), ``prefill`` (prompt tokens) and ``decode`` (generated tokens). The effective
vector of a token is the sum of the global and the request's base and phase tiers.
"""

import binascii
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal

import blake3
import numpy as np
import pybase64
from pydantic import BaseModel, ConfigDict, StrictInt, ValidationError

from vllm_interp.hooks import (
    HOOK_SPELLINGS,
    Hook,
    ModelShape,
    canonical_hook,
    is_site_name,
    parse_site_name,
    site_name,
)
from vllm_interp.sae import SparseAutoencoder
from vllm_interp.site_vectors import check_site_vector, entry_vector

Tier = Literal["base", "prefill", "decode"]
TIERS: tuple[Tier, ...] = ("base", "prefill", "decode")
# The request fields (HTTP and SamplingParams helpers) that carry each tier.
REQUEST_FIELDS: dict[Tier, str] = {
    "base": "steering_vectors",
    "prefill": "prefill_steering_vectors",
    "decode": "decode_steering_vectors",
}


class SteeringError(ValueError):
    """A steering spec the engine cannot apply; the message starts with the offending field."""


class PackedVectors(BaseModel):
    model_config = ConfigDict(extra="forbid")

    dtype: Literal["float32", "bfloat16"]
    shape: tuple[int, int]
    layers: list[int]
    data: str
    scales: list[float] | None = None


class SiteBlock(Mapping[str, np.ndarray]):
    """Site name -> vector, held as the rows of one ``[sites, hidden]`` float32 matrix, as the wire carries a
    tier: decoding a request's vectors is one buffer view, and writing them into a steering table copies one
    block instead of a vector per site."""

    __slots__ = ("names", "matrix", "_rows")

    def __init__(self, names: tuple[str, ...], matrix: np.ndarray) -> None:
        self.names, self.matrix = names, matrix
        self._rows = {name: i for i, name in enumerate(names)}

    def __getitem__(self, name: str) -> np.ndarray:
        return self.matrix[self._rows[name]]

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def site_block(sites: Mapping[str, np.ndarray]) -> SiteBlock:
    """``sites`` (one or more) as a float32 block (itself when it is one)."""
    if isinstance(sites, SiteBlock):
        return sites
    names = tuple(sites)
    return SiteBlock(names, np.stack([np.asarray(sites[name], dtype="<f4") for name in names]))


@dataclass(frozen=True)
class SteeringVectors:
    """Normalised steering: tier -> site name -> float32 vector (scales applied). Immutable."""

    tiers: Mapping[Tier, Mapping[str, np.ndarray]] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return not any(self.tiers.get(tier) for tier in TIERS)

    @property
    def affects_prefill(self) -> bool:
        return bool(self.tiers.get("base") or self.tiers.get("prefill"))

    def phase_vectors(self, phase: Literal["prefill", "decode"]) -> Mapping[str, np.ndarray]:
        """Base plus the phase's tier, summed per site (a tier alone: that tier as it is)."""
        base, own = self.tiers.get("base", {}), self.tiers.get(phase, {})
        return _sum_sites(base, own) if base and own else base or own

    def __add__(self, other: "SteeringVectors") -> "SteeringVectors":
        if self.is_empty or other.is_empty:  # the other one as it is (its digest already computed, if it was)
            return other if self.is_empty else self
        return SteeringVectors({t: _sum_sites(self.tiers.get(t, {}), other.tiers.get(t, {})) for t in TIERS})

    def merged(self, update: "SteeringVectors") -> "SteeringVectors":
        """``update``'s sites replace this one's, tier by tier (``POST /v1/steering/set`` without replace)."""
        return SteeringVectors({t: {**self.tiers.get(t, {}), **update.tiers.get(t, {})} for t in TIERS})

    def digest(self) -> str:
        """Identifies the exact vectors; identical specs share table slots and prefix-cache blocks."""
        return self._digest

    @cached_property
    def _digest(self) -> str:
        # BLAKE3 (vLLM hashes multimodal inputs with it) over every vector in one buffer, then the sites' names
        # and sizes. One update: BLAKE3 hashes the 1 KiB chunks of one aligned run in parallel, and fed a name
        # then a vector per site it hashed chunk by chunk (an all-layer request's vectors at hidden 2048 on the
        # API server's one event loop: 100 us that way, 18 this way; dev CPU).
        vectors, names = [], []
        for tier in TIERS:
            for name in sorted(self.tiers.get(tier, {})):
                vector = np.ascontiguousarray(self.tiers[tier][name], dtype="<f4")
                vectors.append(vector)
                names.append(f"{tier}/{name}:{vector.size}")
        hasher = blake3.blake3()
        if vectors:
            hasher.update(np.concatenate(vectors).view(np.uint8))
        hasher.update("\n".join(names).encode())
        return hasher.hexdigest()[:32]

    def to_wire(self) -> dict[str, dict[str, Any]]:
        """msgpack-plain form for ``extra_args`` and RPCs: per tier its site names and one buffer of their
        little-endian float32 vectors, one after another. msgpack carries bytes as they are, so neither side
        spends time on base64 (about 0.6 ms per all-layer request in the worker, where every steered request's
        vectors are read as it is admitted), and the worker reads a tier as one block (``SiteBlock``)."""
        wire = {}
        for tier, sites in self.tiers.items():
            if sites:
                block = site_block(sites)
                wire[tier] = {"sites": list(block.names), "data": block.matrix.tobytes()}
        return wire

    @classmethod
    def from_wire(cls, wire: Mapping[str, Mapping[str, Any]]) -> "SteeringVectors":
        tiers = {}
        for tier, block in wire.items():
            names = tuple(block["sites"])
            tiers[tier] = SiteBlock(names, np.frombuffer(block["data"], dtype="<f4").reshape(len(names), -1))
        return cls(tiers)

    def to_json(self) -> dict[str, dict[str, dict[str, list[float]]]]:
        """The JSON spec form (``GET /v1/steering``): tier -> hook -> layer -> list of floats."""
        out: dict[str, dict[str, dict[str, list[float]]]] = {}
        for tier, sites in self.tiers.items():
            for name, vec in sites.items():
                layer, hook = parse_site_name(name)
                out.setdefault(tier, {}).setdefault(hook, {})[str(layer)] = vec.tolist()
        return out


def _sum_sites(a: Mapping[str, np.ndarray], b: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = dict(a)
    for name, vec in b.items():
        out[name] = out[name] + vec if name in out else vec
    return out


def _decode_packed(packed: PackedVectors, where: str, shape: ModelShape) -> dict[int, np.ndarray]:
    rows, width = packed.shape
    if width != shape.hidden_size:
        raise SteeringError(f"{where}.shape: hidden size {width} != model hidden size {shape.hidden_size}")
    if rows != len(packed.layers):
        raise SteeringError(f"{where}.shape: {rows} rows for {len(packed.layers)} layers")
    if len(set(packed.layers)) != len(packed.layers):
        raise SteeringError(f"{where}.layers: must not repeat a layer")
    if packed.scales is not None and len(packed.scales) != rows:
        raise SteeringError(f"{where}.scales: {len(packed.scales)} scales for {rows} rows")
    try:
        raw = pybase64.b64decode(packed.data, validate=True)
    except (binascii.Error, ValueError):
        raise SteeringError(f"{where}.data: not valid base64") from None
    itemsize = 4 if packed.dtype == "float32" else 2
    if len(raw) != rows * width * itemsize:
        raise SteeringError(f"{where}.data: {len(raw)} bytes, expected {rows * width * itemsize} for {packed.dtype}")
    if packed.dtype == "float32":
        matrix = np.frombuffer(raw, dtype="<f4").reshape(rows, width)
    else:  # bfloat16 is the upper half of a float32
        matrix = (np.frombuffer(raw, dtype="<u2").astype("<u4") << 16).view("<f4").reshape(rows, width)
    if packed.scales is None:  # rows of the decoded buffer as they are (read-only views: vectors are immutable)
        return {layer: matrix[i] for i, layer in enumerate(packed.layers)}
    return {layer: matrix[i] * np.float32(packed.scales[i]) for i, layer in enumerate(packed.layers)}


def validate_steering_tier(raw: Any, *, where: str, shape: ModelShape,
                           saes: Mapping[str, SparseAutoencoder] | None = None) -> dict[str, np.ndarray]:
    """One tier's spec -> site name -> vector. Checks hooks, layers, sizes, finiteness; ``where`` is the
    field name errors start with. Keys are hooks (either spelling) mapping layers to entries, or whole site
    names (``12.post_block``, ``blocks.12.hook_resid_post``) mapping to one entry; an entry may name an SAE
    feature (``{sae, feature, scale}``) of an SAE in ``saes`` that reads the same site."""
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise SteeringError(f"{where}: expected an object mapping hook -> layer -> vector")
    sites: dict[str, np.ndarray] = {}
    for key, value in raw.items():
        key_where = f"{where}.{key}"
        for layer, hook, vector, entry_where in _tier_entries(key, value, key_where, shape, saes or {}):
            if not 0 <= layer < shape.num_layers:
                raise SteeringError(f"{entry_where}: layer out of range [0, {shape.num_layers})")
            check_site_vector(vector, entry_where, shape.hidden_size, SteeringError)
            name = site_name(layer, hook)
            if name in sites:
                raise SteeringError(f"{entry_where}: site {name} is given twice in this tier")
            sites[name] = vector.astype(np.float32, copy=False)
    return sites


def _tier_entries(key: Any, value: Any, where: str, shape: ModelShape, saes: Mapping[str, SparseAutoencoder]
                  ) -> list[tuple[int, Hook, np.ndarray, str]]:
    """(layer, hook, vector, field) of every entry under one key of a tier's spec."""
    hook = canonical_hook(key)
    if hook is None:
        if not is_site_name(key):
            raise SteeringError(f"{where}: unknown hook or site (hooks: {', '.join(HOOK_SPELLINGS)}; sites: "
                                "'12.post_block' or 'blocks.12.hook_resid_post')")
        layer, hook = parse_site_name(key)
        return [(layer, hook, _entry(value, where, layer, hook, saes), where)]
    if isinstance(value, Mapping) and "data" in value:
        try:
            vectors = _decode_packed(PackedVectors.model_validate(value), where, shape)
        except ValidationError as exc:
            first = exc.errors()[0]
            raise SteeringError(f"{where}.{'.'.join(map(str, first['loc']))}: {first['msg']}") from None
        return [(layer, hook, vector, f"{where}.{layer}") for layer, vector in vectors.items()]
    if not isinstance(value, Mapping):
        raise SteeringError(f"{where}: expected a layer -> vector object or the packed form")
    entries = []
    for layer, entry in value.items():
        if not (isinstance(layer, int) or (isinstance(layer, str) and layer.lstrip("-").isdigit())):
            raise SteeringError(f"{where}.{layer}: layer must be an integer")
        entries.append((int(layer), hook, _entry(entry, f"{where}.{layer}", int(layer), hook, saes),
                        f"{where}.{layer}"))
    return entries


def _entry(raw: Any, where: str, layer: int, hook: Hook, saes: Mapping[str, SparseAutoencoder]) -> np.ndarray:
    if isinstance(raw, Mapping) and "sae" in raw:
        return sae_feature_vector(raw, where, site_name(layer, hook), saes)
    return entry_vector(raw, where, SteeringError)


class FeatureEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    sae: str
    feature: StrictInt
    scale: float = 1.0


def sae_feature_vector(raw: Any, where: str, site: str, saes: Mapping[str, SparseAutoencoder]) -> np.ndarray:
    """``scale * W_dec[feature]`` of ``{sae, feature, scale}``; the SAE must read ``site``."""
    try:
        entry = FeatureEntry.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(map(str, first["loc"]))
        raise SteeringError(f"{where}{'.' + loc if loc else ''}: {first['msg']}") from None
    sae = saes.get(entry.sae)
    if sae is None:
        loaded = ", ".join(sorted(saes)) or "none; start the engine with --sae NAME=DIR"
        raise SteeringError(f"{where}.sae: unknown SAE {entry.sae!r} (loaded: {loaded})")
    if sae.site != site:
        raise SteeringError(f"{where}.sae: SAE {entry.sae!r} reads {sae.site} "
                            f"({site_name(sae.layer, sae.hook, 'transformer_lens')}), not {site}")
    if not 0 <= entry.feature < sae.num_features:
        raise SteeringError(f"{where}.feature: {entry.feature} out of range [0, {sae.num_features})")
    return sae.W_dec[entry.feature] * np.float32(entry.scale)


def validate_steering(
    tiers: Mapping[Tier, Any], *, shape: ModelShape, enabled: bool, fields: Mapping[Tier, str] = REQUEST_FIELDS,
    saes: Mapping[str, SparseAutoencoder] | None = None,
) -> SteeringVectors:
    """The one validation of a steering spec, shared by the HTTP layer, the offline API and the worker.

    ``tiers`` maps tier -> raw spec (None or missing: nothing); ``fields`` names each tier in errors.
    """
    given = {tier: raw for tier, raw in tiers.items() if raw}
    if given and not enabled:
        raise SteeringError(f"{fields[next(iter(given))]}: steering is not enabled on this engine (--enable-steering)")
    return SteeringVectors({
        tier: validate_steering_tier(raw, where=fields[tier], shape=shape, saes=saes) for tier, raw in given.items()
    })


def pack_vectors(vectors: Mapping[int, Any], dtype: Literal["float32", "bfloat16"] = "float32") -> dict[str, Any]:
    """Build the compact wire form of layer -> vector (numpy, torch or lists) for one hook."""
    layers = sorted(vectors)
    matrix = np.stack([np.asarray(vectors[layer], dtype=np.float32) for layer in layers])
    if dtype == "float32":
        raw = matrix.astype("<f4").tobytes()
    else:  # round to nearest even, keep the upper 16 bits
        bits = matrix.astype("<f4").view("<u4")
        raw = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2").tobytes()
    return {"dtype": dtype, "shape": list(matrix.shape), "layers": layers, "data": pybase64.b64encode_as_string(raw)}
