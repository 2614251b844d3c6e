"""Sparse autoencoders in SAELens's on-disk format: steering by feature and the ``sae_features`` consumer.

``--sae NAME=DIR`` names a directory holding ``cfg.json`` and ``sae_weights.safetensors`` as SAELens saves
them (``W_enc [d_in, d_sae]``, ``b_enc [d_sae]``, ``W_dec [d_sae, d_in]``, ``b_dec [d_in]``, ``threshold
[d_sae]`` for JumpReLU). The config's hook name (top-level ``hook_name`` in SAELens 5, ``metadata.hook_name``
in 6) gives the site, in TransformerLens's spelling (``blocks.6.hook_resid_post``). Encoding follows SAELens:
``pre = (x - b_dec * apply_b_dec_to_input) @ W_enc + b_enc``, then ``relu`` (standard), ``relu`` where
``pre > threshold`` (jumprelu) or the ``k`` largest ``pre`` through ``relu`` (topk). What SAELens can
configure beyond that (activation normalisation, per-head hooks, other architectures) is refused at start-up
with the field named, never applied approximately.

Both the frontend (steering entries resolve to ``scale * W_dec[feature]`` there) and every worker (for
``sae_features``) load the SAEs at start-up (``load_saes``); they reach requests' validation through
``EngineFacts``, never through process state (several engines may share a process).
"""

import json
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load_file

from vllm_interp.hooks import Hook, parse_site_name, site_name

CONFIG_FILE = "cfg.json"
WEIGHTS_FILE = "sae_weights.safetensors"
ARCHITECTURES = ("standard", "jumprelu", "topk")


class SaeError(ValueError):
    """An SAE directory vllm-interp cannot use as specified."""


@dataclass(frozen=True, eq=False)
class SparseAutoencoder:
    name: str
    layer: int
    hook: Hook
    architecture: str
    W_enc: np.ndarray  # noqa: N815 (SAELens's parameter names)
    b_enc: np.ndarray
    W_dec: np.ndarray  # noqa: N815
    b_dec: np.ndarray
    apply_b_dec_to_input: bool
    threshold: np.ndarray | None = None
    k: int | None = None

    @property
    def site(self) -> str:
        return site_name(self.layer, self.hook)

    @property
    def num_features(self) -> int:
        return self.W_dec.shape[0]

    def encode(self, rows: np.ndarray) -> np.ndarray:
        """Feature activations ``[rows, d_sae]`` (float32) of residual rows ``[rows, d_in]``."""
        x = np.asarray(rows, dtype=np.float32)
        if self.apply_b_dec_to_input:
            x = x - self.b_dec
        pre = x @ self.W_enc + self.b_enc
        if self.architecture == "jumprelu":
            return np.where(pre > self.threshold, np.maximum(pre, 0), 0).astype(np.float32)
        if self.architecture == "topk":
            kept = np.argpartition(-pre, self.k - 1, axis=-1)[:, : self.k]
            out = np.zeros_like(pre)
            np.put_along_axis(out, kept, np.maximum(np.take_along_axis(pre, kept, axis=-1), 0), axis=-1)
            return out
        return np.maximum(pre, 0)

    def top_features(self, rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, values)``, each ``[rows, k]``: each row's ``k`` largest activations, largest first (ties:
        lower id first)."""
        acts = self.encode(rows)
        k = min(k, acts.shape[1])
        order = np.argsort(-acts, axis=-1, kind="stable")[:, :k]
        return order.astype(np.int64), np.take_along_axis(acts, order, axis=-1)


def parse_sae_flag(flag: str) -> tuple[str, str]:
    """``NAME=DIR`` -> (name, directory)."""
    name, sep, directory = flag.partition("=")
    if not sep or not name or not directory:
        raise SaeError(f"--sae {flag!r}: expected NAME=DIR")
    return name, directory


def load_sae(name: str, directory: str | Path, *, num_layers: int, hidden_size: int) -> SparseAutoencoder:
    """Read and check one SAE directory against the model; ``SaeError`` names what does not fit."""
    where = f"--sae {name}"
    directory = Path(directory)
    try:
        cfg = json.loads((directory / CONFIG_FILE).read_text())
        weights = load_file(directory / WEIGHTS_FILE)
    except (OSError, ValueError) as exc:
        raise SaeError(f"{where}: cannot read {CONFIG_FILE} and {WEIGHTS_FILE} in {directory}: {exc}") from None
    metadata = cfg.get("metadata") or {}
    hook_name = cfg.get("hook_name") or metadata.get("hook_name")
    try:
        layer, hook = parse_site_name(str(hook_name))
    except ValueError:
        raise SaeError(f"{where}: hook_name {hook_name!r} is not a residual-stream site "
                       "(blocks.<layer>.hook_resid_pre|mid|post)") from None
    if not 0 <= layer < num_layers:
        raise SaeError(f"{where}: hook_name {hook_name!r}: layer out of range for a model with {num_layers} layers")
    architecture = cfg.get("architecture", "standard")
    if architecture not in ARCHITECTURES:
        raise SaeError(f"{where}: architecture {architecture!r} is not supported (supported: {ARCHITECTURES})")
    for key, plain in (("normalize_activations", "none"), ("reshape_activations", "none"),
                       ("hook_head_index", None), ("finetuning_scaling_factor", False)):
        if cfg.get(key, plain) not in (plain, None, False, "none"):
            raise SaeError(f"{where}: {key}={cfg[key]!r} is not supported")
    missing = [k for k in ("W_enc", "b_enc", "W_dec", "b_dec") if k not in weights]
    if architecture == "jumprelu" and "threshold" not in weights:
        missing.append("threshold")
    if missing:
        raise SaeError(f"{where}: {WEIGHTS_FILE} lacks {', '.join(missing)}")
    arrays = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in weights.items()}
    d_sae = arrays["W_dec"].shape[0]
    expected = {"W_enc": (hidden_size, d_sae), "b_enc": (d_sae,), "W_dec": (d_sae, hidden_size),
                "b_dec": (hidden_size,), **({"threshold": (d_sae,)} if architecture == "jumprelu" else {})}
    for key, shape in expected.items():
        if arrays[key].shape != shape:
            raise SaeError(f"{where}: {key} has shape {list(arrays[key].shape)}, expected {list(shape)} "
                           f"(model hidden size {hidden_size})")
    k = _topk_k(cfg, where, d_sae) if architecture == "topk" else None
    return SparseAutoencoder(name, layer, hook, architecture, arrays["W_enc"], arrays["b_enc"], arrays["W_dec"],
                             arrays["b_dec"], bool(cfg.get("apply_b_dec_to_input", True)), arrays.get("threshold"), k)


def _topk_k(cfg: Mapping[str, Any], where: str, d_sae: int) -> int:
    k = cfg.get("k", (cfg.get("activation_fn_kwargs") or {}).get("k"))
    if not isinstance(k, int) or not 1 <= k <= d_sae:
        raise SaeError(f"{where}: a topk SAE needs k in [1, {d_sae}] (cfg.json 'k'), got {k!r}")
    return k


@cache
def _load_cached(name: str, directory: str, num_layers: int, hidden_size: int) -> SparseAutoencoder:
    return load_sae(name, directory, num_layers=num_layers, hidden_size=hidden_size)


def load_saes(flags: tuple[str, ...], *, num_layers: int, hidden_size: int) -> dict[str, SparseAutoencoder]:
    """The ``--sae`` flags' SAEs by name (each directory read once per process)."""
    saes: dict[str, SparseAutoencoder] = {}
    for flag in flags:
        name, directory = parse_sae_flag(flag)
        if name in saes:
            raise SaeError(f"--sae {name}: given twice")
        saes[name] = _load_cached(name, directory, num_layers, hidden_size)
    return saes
