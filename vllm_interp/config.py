"""InterpConfig: the engine-wide vllm-interp settings, carried to every process in ``additional_config``."""

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any

from vllm_interp.hooks import HOOKS

ADDITIONAL_CONFIG_KEY = "vllm_interp"
# Bumped whenever the installed hook sites (their placement or the ops they call) change, so that vLLM's
# compile cache, keyed on additional_config, never reuses a graph traced with other hooks.
SITE_SCHEME = "residual-sites/3:" + ",".join(HOOKS)
# The capture overload policies (vllm_interp.capture.dispatch); kept here so the config has no torch import.
OVERLOAD_POLICIES = ("block", "drop", "spill")
DEFAULT_MAX_STEERING_CONFIGS = 8


def parse_consumer_spec(spec: str) -> tuple[str, dict[str, str]]:
    """Split a ``name:key=val,key=val`` capture-consumer flag into its name and options."""
    name, _, opts = spec.partition(":")
    if not name:
        raise ValueError(f"capture consumer {spec!r}: expected 'name[:key=val,...]'")
    options: dict[str, str] = {}
    for item in filter(None, opts.split(",")):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"capture consumer {spec!r}: option {item!r} is not 'key=val'")
        options[key] = value
    return name, options


@dataclass(frozen=True)
class InterpConfig:
    enable_steering: bool = False
    # Distinct per-request steering configs resident at once (each owns two rows of every layer's table).
    max_steering_configs: int = DEFAULT_MAX_STEERING_CONFIGS
    enable_patching: bool = False
    # `--capture-consumers` flags: "name[:key=val,...]".
    capture_consumers: tuple[str, ...] = ()
    # A capture spec (JSON) applied to every request, besides the request's own.
    capture_global: str = ""
    capture_overload_policy: str = "block"
    package_version: str = ""
    site_scheme: str = SITE_SCHEME

    def __post_init__(self) -> None:
        if self.max_steering_configs < 1:
            raise ValueError(f"max_steering_configs must be >= 1, got {self.max_steering_configs}")
        if self.capture_overload_policy not in OVERLOAD_POLICIES:
            raise ValueError(f"capture_overload_policy must be one of {', '.join(OVERLOAD_POLICIES)}, "
                             f"got {self.capture_overload_policy!r}")
        for spec in self.capture_consumers:
            parse_consumer_spec(spec)
        if self.capture_global:
            if not self.capture_consumers:
                raise ValueError("capture_global needs capture consumers (--capture-consumers)")
            try:
                json.loads(self.capture_global)
            except ValueError as exc:
                raise ValueError(f"capture_global: not valid JSON ({exc})") from None
        if not self.package_version:
            from vllm_interp import __version__

            object.__setattr__(self, "package_version", __version__)

    @property
    def consumer_names(self) -> list[str]:
        return [parse_consumer_spec(spec)[0] for spec in self.capture_consumers]

    @property
    def hooks_needed(self) -> bool:
        return self.enable_steering or self.enable_patching or bool(self.capture_consumers)

    def compute_hash(self) -> str:
        """Digest of everything that shapes the traced forward (vLLM also hashes additional_config)."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["capture_consumers"] = list(self.capture_consumers)
        return data

    def to_additional_config(self, existing: dict[str, Any] | None = None) -> dict[str, Any]:
        merged = dict(existing or {})
        merged[ADDITIONAL_CONFIG_KEY] = {**self.to_dict(), "hash": self.compute_hash()}
        return merged

    @classmethod
    def from_additional_config(cls, additional_config: dict[str, Any] | None) -> "InterpConfig | None":
        raw = (additional_config or {}).get(ADDITIONAL_CONFIG_KEY)
        if raw is None:
            return None
        raw = {k: v for k, v in raw.items() if k != "hash"}
        raw["capture_consumers"] = tuple(raw.get("capture_consumers", ()))
        return cls(**raw)
