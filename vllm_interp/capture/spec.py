"""The capture spec: which residual rows of a request go to which consumer.

Wire format (a request's ``capture`` field, and a global spec)::

    {consumer_name: {"hooks": {hook: [layers] | "all"} | [site names] | "all",
                     "positions": "last_prompt" | "all_prompt" | "all_generated" | "all" | [ints],
                     "tag": str?, "naming": "vllm_interp" | "transformer_lens", ...consumer options}}

Hooks and sites may be spelled as TransformerLens does (``hook_resid_post``, ``blocks.12.hook_resid_post``);
``naming`` picks how the consumer's tensors are named (``12.post_block`` or ``blocks.12.hook_resid_post``).

``validate_capture_spec`` is the one validation, used by the HTTP layer, the offline API and the worker.
Options other than ``hooks``/``positions``/``tag``/``naming`` belong to the consumer and are checked by its
``validate_options``. Positions are absolute token indices (prompt then generated tokens); the last
generated token is never fed through the model, so it has no residual.
"""

import re
from collections.abc import Mapping
from functools import lru_cache
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, StrictInt, ValidationError, field_validator

from vllm_interp.capture.consumer import EngineFacts
from vllm_interp.hooks import (
    HOOK_INDEX,
    HOOK_SPELLINGS,
    HOOKS,
    Hook,
    Naming,
    canonical_hook,
    parse_site_name,
    site_name,
)
from vllm_interp.request_args import MAX_TOKEN_POSITION, oversized_integer

PositionKeyword = Literal["all", "all_prompt", "last_prompt", "all_generated"]
# A tag names files and directories: path segments of safe characters, never "." or "..".
_TAG_SEGMENT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}")
MAX_TAG_LENGTH = 256


class CaptureSpecError(ValueError):
    """A capture spec the engine cannot apply; the message starts with the offending field's path."""


class ConsumerSpec(BaseModel):
    """What one consumer captures for one request (consumer options ride along as extra fields)."""

    model_config = ConfigDict(extra="allow", frozen=True)

    hooks: dict[Hook, list[int] | Literal["all"]] | Literal["all"] = "all"
    positions: list[StrictInt] | PositionKeyword = "last_prompt"
    tag: str | None = None
    naming: Naming = "vllm_interp"

    @field_validator("hooks")
    @classmethod
    def _some_hooks(cls, value: dict[str, Any] | str) -> dict[str, Any] | str:
        if value == "all":
            return value
        if not value:
            raise ValueError("name at least one hook")
        for layers in value.values():
            if isinstance(layers, list) and not layers:
                raise ValueError("a hook's layer list must not be empty")
        return value

    @field_validator("positions")
    @classmethod
    def _positions(cls, value: Any) -> Any:
        if isinstance(value, list):
            if not value:
                raise ValueError("must not be empty")
            if len(set(value)) != len(value):
                raise ValueError("must not repeat entries")
            if min(value) < 0 or max(value) >= MAX_TOKEN_POSITION:
                raise ValueError(f"positions are absolute token indices in [0, {MAX_TOKEN_POSITION})")
        return value

    @field_validator("tag")
    @classmethod
    def _tag(cls, value: str | None) -> str | None:
        if value is None:
            return value
        segments = value.split("/")
        if len(value) > MAX_TAG_LENGTH or not all(_TAG_SEGMENT.fullmatch(s) for s in segments):
            raise ValueError(
                "must be '/'-separated segments of letters, digits, '_', '-', '.', each starting with a letter, "
                f"digit or '_' (no '..', no absolute paths), at most {MAX_TAG_LENGTH} characters"
            )
        return value

    @property
    def options(self) -> dict[str, Any]:
        """The consumer's own options (every field that is not hooks/positions/tag)."""
        return dict(self.model_extra or {})

    def sites(self, num_layers: int) -> tuple[tuple[int, Hook], ...]:
        """(layer, hook) pairs in layer-major, hook order: the order of tensors in every result."""
        return _sites(self._hooks_key(), num_layers)

    def site_names(self, num_layers: int) -> list[str]:
        """The tensors' names, in the spec's ``naming``."""
        return [site_name(layer, hook, self.naming) for layer, hook in self.sites(num_layers)]

    def _hooks_key(self) -> str | tuple[tuple[str, str | tuple[int, ...]], ...]:
        """``hooks`` in a hashable form."""
        if self.hooks == "all":
            return "all"
        return tuple((hook, layers if isinstance(layers, str) else tuple(layers))
                     for hook, layers in self.hooks.items())

    def select(self, positions: np.ndarray, prompt_len: int) -> np.ndarray:
        """Boolean mask over ``positions``: which of them this spec captures."""
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

    def last_position(self, prompt_len: int) -> int | None:
        """The last position the spec can select (None: generated positions, without end)."""
        match self.positions:
            case "all" | "all_generated":
                return None
            case "all_prompt" | "last_prompt":
                return prompt_len - 1
            case explicit:
                return max(explicit)

    def expected_positions(self, prompt_len: int, num_computed: int) -> np.ndarray:
        """Positions captured once ``num_computed`` tokens of the sequence went through the model, ascending."""
        computed = np.arange(num_computed, dtype=np.int64)
        return computed[self.select(computed, prompt_len)]

    def needs_prompt_prefix(self, prompt_len: int) -> bool:
        """Whether the spec captures prompt positions before the last one: those may be served from the
        prefix cache (vLLM always computes the last prompt token), so the request must bypass it. Asked for every
        capturing request on the scheduler's thread: answered from the selection's form, not a mask."""
        match self.positions:
            case "all" | "all_prompt":
                return prompt_len > 1
            case "last_prompt" | "all_generated":
                return False
            case explicit:
                return min(explicit) < prompt_len - 1


CaptureSpec = dict[str, ConsumerSpec]


# Every request decodes its own spec, and most requests of a workload name the same sites: the site list is
# computed once per distinct ``hooks`` (bounded: the cache drops the least recently used).
@lru_cache(maxsize=1024)
def _sites(hooks_key: str | tuple, num_layers: int) -> tuple[tuple[int, Hook], ...]:
    hooks = dict.fromkeys(HOOKS, "all") if hooks_key == "all" else dict(hooks_key)
    chosen = {
        (layer, hook)
        for hook, layers in hooks.items()
        for layer in (range(num_layers) if layers == "all" else layers)
    }
    return tuple(sorted(chosen, key=lambda site: (site[0], HOOK_INDEX[site[1]])))


def _is_type_tag(part: Any) -> bool:
    """Pydantic's loc names union members and key checks ("list[int]", "[key]"); users know fields only."""
    return isinstance(part, str) and ("[" in part or part.startswith(("literal", "function")))


def _field_error(exc: ValidationError, prefix: str) -> CaptureSpecError:
    first = exc.errors()[0]
    path = ".".join(str(p) for p in first["loc"] if not _is_type_tag(p))
    return CaptureSpecError(f"{prefix}{'.' + path if path else ''}: {first['msg']}")


def _canonical_hooks(raw: Any, where: str) -> Any:
    """TransformerLens spellings and lists of site names as the ``{hook: layers}`` form ConsumerSpec takes."""
    if isinstance(raw, list):
        layers: dict[str, list[int]] = {}
        for i, name in enumerate(raw):
            try:
                layer, hook = parse_site_name(name)
            except (ValueError, TypeError, AttributeError):
                raise CaptureSpecError(f"{where}.{i}: {name!r} is not a site name ('12.post_block' or "
                                       "'blocks.12.hook_resid_post')") from None
            layers.setdefault(hook, []).append(layer)
        if not layers:
            raise CaptureSpecError(f"{where}: name at least one site")
        return {hook: sorted(set(found)) for hook, found in layers.items()}
    if not isinstance(raw, Mapping):
        return raw
    canonical: dict[Any, Any] = {}
    for key, layers in raw.items():
        hook = canonical_hook(key)
        if hook is None:
            raise CaptureSpecError(f"{where}.{key}: unknown hook (known: {', '.join(HOOK_SPELLINGS)})")
        if hook in canonical:
            raise CaptureSpecError(f"{where}.{key}: hook {hook} is given twice (two spellings)")
        canonical[hook] = layers
    return canonical


def validate_capture_spec(
    raw: Any, *, engine: EngineFacts, consumers: Mapping[str, Any], field: str = "capture"
) -> CaptureSpec:
    """Parse and check a capture spec against the engine (its model's layers, its SAEs) and its enabled
    consumers.

    ``consumers`` maps each enabled consumer name to its class (whose ``validate_options`` checks the
    consumer's own options, and ``validate_hooks`` the sites it can take). Errors name the field, e.g.
    ``capture.filesystem.hooks.post_block``.
    """
    if not isinstance(raw, Mapping) or not raw:
        raise CaptureSpecError(f"{field}: expected an object mapping consumer names to specs")
    spec: CaptureSpec = {}
    for name, entry in raw.items():
        prefix = f"{field}.{name}"
        if name not in consumers:
            enabled = ", ".join(sorted(consumers)) or "none"
            raise CaptureSpecError(f"{prefix}: consumer not enabled on this engine (enabled: {enabled})")
        if isinstance(entry, Mapping) and "hooks" in entry:
            entry = {**entry, "hooks": _canonical_hooks(entry["hooks"], f"{prefix}.hooks")}
        try:
            parsed = ConsumerSpec.model_validate(entry)
        except ValidationError as exc:
            raise _field_error(exc, prefix) from None
        for hook, layers in (parsed.hooks if parsed.hooks != "all" else {}).items():
            if layers != "all":
                bad = [layer for layer in layers if not 0 <= layer < engine.num_layers]
                if bad:
                    raise CaptureSpecError(f"{prefix}.hooks.{hook}: layers {bad} out of range for a model with "
                                           f"{engine.num_layers} layers")
        try:
            options = consumers[name].validate_options(parsed.options, engine)
            hooks = consumers[name].validate_hooks(parsed.hooks if "hooks" in parsed.model_fields_set else None,
                                                   options, engine)
        except ValueError as exc:
            raise CaptureSpecError(f"{prefix}.{exc}") from None
        if (path := oversized_integer(dict(options))) is not None:
            raise CaptureSpecError(f"{prefix}.{path}: integer out of the 64-bit range")
        update = dict(options) if options != parsed.options else {}
        if hooks != parsed.hooks:
            update["hooks"] = hooks
        spec[name] = parsed.model_copy(update=update) if update else parsed
    return spec


def spec_to_wire(spec: CaptureSpec) -> dict[str, Any]:
    return {name: entry.model_dump(mode="json") for name, entry in spec.items()}


def spec_from_wire(wire: Mapping[str, Any]) -> CaptureSpec:
    """Rebuild an already-validated spec (worker side: the frontend validated it)."""
    return {name: ConsumerSpec.model_validate(entry) for name, entry in wire.items()}
