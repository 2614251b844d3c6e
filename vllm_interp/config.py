"""InterpConfig: the engine-wide vllm-interp settings, carried to every process in ``additional_config``."""

import hashlib
import json
from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from vllm_interp.hooks import HOOKS
from vllm_interp.sae import parse_sae_flag

ADDITIONAL_CONFIG_KEY = "vllm_interp"
# Bumped whenever the installed hook sites (their placement or the ops they call) change, so that vLLM's
# compile cache, keyed on InterpConfig.compute_hash, never reuses a graph traced with other hooks.
SITE_SCHEME = "residual-sites/5:" + ",".join(HOOKS)
# The capture overload policies (vllm_interp.capture.dispatch); kept here so the config has no torch import.
OVERLOAD_POLICIES = ("block", "drop", "spill")
DEFAULT_MAX_STEERING_CONFIGS = 8
DEFAULT_MAX_PATCH_ROWS = 1024
DEFAULT_PATCH_SOURCE_BYTES = 1 << 30
# Bounds the admitting process applies to what requests may ask for (docs/limits.md). The workers never
# need them, so they are not part of InterpConfig: each front door holds its own ``FrontendLimits``.
DEFAULT_MAX_SWEEP_CELLS = 4096
DEFAULT_MAX_INTERP_BODY_BYTES = 16 << 20
# A handful of sites is the usual steering; 256 still covers every hook of an 85-layer model in one tier.
DEFAULT_MAX_STEERING_SITES_PER_REQUEST = 256
DEFAULT_MAX_NAMED_VECTORS = 256
DEFAULT_MAX_CAPTURE_BYTES_PER_REQUEST = 1 << 30
# The capture consumer --enable-patching adds: it keeps source runs for patching in worker memory.
PATCH_SOURCE_CONSUMER = "patch_source"


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
    # Patched rows one step can hold (the site op's value table, shared by every site).
    max_patch_rows: int = DEFAULT_MAX_PATCH_ROWS
    # Worker memory for patch source runs (least recently used runs are evicted beyond it).
    patch_source_bytes: int = DEFAULT_PATCH_SOURCE_BYTES
    # Rows a step replaying CUDA graphs can capture (a buffer of this height per site); 0: capturing steps
    # always run eagerly; None: as many as vLLM's largest CUDA graph has tokens (graph_read_rows).
    max_graph_capture_rows: int | None = None
    # `--capture-consumers` flags: "name[:key=val,...]".
    capture_consumers: tuple[str, ...] = ()
    # A capture spec (JSON) applied to every request, besides the request's own.
    capture_global: str = ""
    capture_overload_policy: str = "block"
    # The engine processes' interpreter switch interval (``sys.setswitchinterval``), in ms; 0: Python's default
    # (5 ms). A forward thread that gives up the interpreter lock for a torch or CUDA call takes it back from a
    # consumer thread that holds it after at most this long.
    engine_switch_interval_ms: float = 0.0
    # `--sae NAME=DIR` flags: sparse autoencoders for feature steering and the sae_features consumer.
    saes: tuple[str, ...] = ()
    package_version: str = ""
    site_scheme: str = SITE_SCHEME

    def __post_init__(self) -> None:
        if self.max_steering_configs < 1:
            raise ValueError(f"max_steering_configs must be >= 1, got {self.max_steering_configs}")
        if self.capture_overload_policy not in OVERLOAD_POLICIES:
            raise ValueError(f"capture_overload_policy must be one of {', '.join(OVERLOAD_POLICIES)}, "
                             f"got {self.capture_overload_policy!r}")
        for name, value in (("max_patch_rows", self.max_patch_rows), ("patch_source_bytes", self.patch_source_bytes)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not 0 <= self.engine_switch_interval_ms <= 1000:
            raise ValueError(f"engine_switch_interval_ms must be within 0-1000, got {self.engine_switch_interval_ms}")
        if self.max_graph_capture_rows is not None and self.max_graph_capture_rows < 0:
            raise ValueError(f"max_graph_capture_rows must be >= 0, got {self.max_graph_capture_rows}")
        names = [parse_sae_flag(flag)[0] for flag in self.saes]
        if duplicated := sorted({name for name in names if names.count(name) > 1}):
            raise ValueError(f"--sae {duplicated[0]}: given twice")
        for spec in self.capture_consumers:
            if parse_consumer_spec(spec)[0] == PATCH_SOURCE_CONSUMER:
                raise ValueError(f"{PATCH_SOURCE_CONSUMER} is enabled by --enable-patching, not --capture-consumers")
        if self.capture_global:
            if not self.consumers:
                raise ValueError("capture_global needs capture consumers (--capture-consumers)")
            try:
                json.loads(self.capture_global)
            except ValueError as exc:
                raise ValueError(f"capture_global: not valid JSON ({exc})") from None
        if not self.package_version:
            from vllm_interp import __version__

            object.__setattr__(self, "package_version", __version__)

    @property
    def consumers(self) -> tuple[str, ...]:
        """Every enabled consumer's flag: ``--capture-consumers``, and ``patch_source`` with patching."""
        return self.capture_consumers + ((PATCH_SOURCE_CONSUMER,) if self.enable_patching else ())

    @property
    def consumer_names(self) -> list[str]:
        return [parse_consumer_spec(spec)[0] for spec in self.consumers]

    def graph_read_rows(self, max_graph_tokens: int) -> int:
        """The height of the sites' graph read buffers, given the most tokens a step replaying a CUDA graph holds
        (vLLM's ``max_cudagraph_capture_size``; 0: no graphs): none without consumers (nothing ever reads). By
        default a row per token of the largest graph, as a step reads at most one row per token: no step that
        vLLM would replay runs eagerly to capture (with 256 rows, an H200's every-token sink phases ran about
        a hundred 257-512-token steps a phase eagerly and moved 0.8 GB/s of rows; with 512, half as many and
        1.0 GB/s, benchmarks/results/bulk-capture-gpu-2026-12-02.md, session 26)."""
        asked = self._read_rows_asked
        return max_graph_tokens if asked is None else asked

    @property
    def _read_rows_asked(self) -> int | None:
        """The rows the flags ask the read buffers for: 0 without consumers, None for vLLM's largest graph."""
        return self.max_graph_capture_rows if self.consumers else 0

    @property
    def hooks_needed(self) -> bool:
        return self.enable_steering or self.enable_patching or bool(self.capture_consumers)

    def compute_hash(self) -> str:
        """Digest of what shapes the traced forward: whether sites are installed, the heights of their tables
        and the code they run. Consumers, their options, SAEs, the global capture spec and memory budgets are
        read at run time, so changing them reuses vLLM's compile cache."""
        graph = {name: getattr(self, name) for name in GRAPH_FIELDS}
        graph["sites_installed"] = self.hooks_needed
        # The buffers' height by default follows vLLM's largest graph, which vLLM's own hash covers.
        graph["graph_read_rows"] = self._read_rows_asked
        return hashlib.sha256(json.dumps(graph, sort_keys=True).encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["capture_consumers"] = list(self.capture_consumers)
        data["saes"] = list(self.saes)
        return data

    def to_additional_config(self, existing: Mapping[str, Any] | None = None) -> "InterpAdditionalConfig":
        return InterpAdditionalConfig({**(existing or {}), ADDITIONAL_CONFIG_KEY: self.to_dict()})

    @classmethod
    def from_additional_config(cls, additional_config: dict[str, Any] | None) -> "InterpConfig | None":
        raw = (additional_config or {}).get(ADDITIONAL_CONFIG_KEY)
        if raw is None:
            return None
        raw = dict(raw)
        raw["capture_consumers"] = tuple(raw.get("capture_consumers", ()))
        raw["saes"] = tuple(raw.get("saes", ()))
        return cls(**raw)


# InterpConfig fields that shape the traced forward (see compute_hash).
GRAPH_FIELDS = ("enable_steering", "max_steering_configs", "enable_patching", "max_patch_rows", "package_version",
                "site_scheme")


class InterpAdditionalConfig(MutableMapping[str, Any]):
    """vLLM's ``additional_config`` with vllm-interp's settings under ``"vllm_interp"``, hashed for vLLM's
    compile cache by what shapes the graph only.

    ``VllmConfig.compute_hash`` hashes a plain dict's whole JSON, so a new filesystem root or SAE would
    recompile the model; an object with ``compute_hash`` (vLLM's ``SupportsHash``, which the field accepts) is
    hashed by that method instead: a user's own entries whole, ours by ``InterpConfig.compute_hash``. It reads
    like a dict for vLLM code that looks entries up.
    """

    def __init__(self, entries: Mapping[str, Any]) -> None:
        self._entries = dict(entries)

    def __getitem__(self, key: str) -> Any:
        return self._entries[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self._entries[key] = value

    def __delitem__(self, key: str) -> None:
        del self._entries[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"InterpAdditionalConfig({self._entries!r})"

    def compute_hash(self) -> str:
        others = {key: value for key, value in self._entries.items() if key != ADDITIONAL_CONFIG_KEY}
        config = InterpConfig.from_additional_config(self._entries)
        ours = config.compute_hash() if config is not None else None
        digest = json.dumps({"others": others, ADDITIONAL_CONFIG_KEY: ours}, sort_keys=True, default=str)
        return hashlib.sha256(digest.encode()).hexdigest()


@dataclass(frozen=True)
class FrontendLimits:
    """What one request (or one server) may ask of the admitting process; field names are the flags' dests
    (``--max-interp-body-bytes`` -> ``max_interp_body_bytes``)."""

    # Bytes of a body that carries vllm-interp fields, or of any body sent to vllm-interp's own routes.
    max_interp_body_bytes: int = DEFAULT_MAX_INTERP_BODY_BYTES
    # Site vectors in one steering spec, all tiers together (a request's own plus its named vectors).
    max_steering_sites_per_request: int = DEFAULT_MAX_STEERING_SITES_PER_REQUEST
    max_named_vectors: int = DEFAULT_MAX_NAMED_VECTORS
    # Worst-case bytes of the rows one request's capture spec selects, all consumers together.
    max_capture_bytes_per_request: int = DEFAULT_MAX_CAPTURE_BYTES_PER_REQUEST
    max_sweep_cells: int = DEFAULT_MAX_SWEEP_CELLS

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"--{field.name.replace('_', '-')} must be a positive integer, got {value!r}")

    @classmethod
    def from_args(cls, args: Any) -> "FrontendLimits":
        """The limits a ``vllm-interp serve`` namespace sets (defaults for flags it lacks)."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if getattr(args, f.name, None) is not None})
