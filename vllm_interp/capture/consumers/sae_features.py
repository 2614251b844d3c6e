"""The ``sae_features`` consumer: each captured row's top-k sparse-autoencoder features instead of the row.

Enable with ``--capture-consumers sae_features`` beside ``--sae NAME=DIR``. A request asks
``{"sae_features": {"sae": NAME, "k": 16, "positions": ...}}`` (``sae`` may be left out when one SAE is
loaded; ``k`` defaults to 16, or the SAE's width when smaller); the SAE's site is what is captured
(``hooks`` may be left out; naming another site is an error). The result, offline and over HTTP::

    {"sae": NAME, "site": "6.post_block", "positions": [...],
     "feature_ids": [[k ints] per position], "feature_values": [[k floats] per position]}

ids are ordered by activation, largest first; features that do not fire have value 0.
"""

from collections.abc import Mapping
from typing import Any

import numpy as np

from vllm_interp.capture.consumer import CaptureConsumer, EngineFacts, RequestCapture
from vllm_interp.hooks import parse_site_name, site_name
from vllm_interp.sae import SparseAutoencoder

DEFAULT_K = 16


def _sae(options: dict[str, Any], saes: Mapping[str, SparseAutoencoder]) -> SparseAutoencoder:
    name = options.get("sae")
    if name is None:
        if len(saes) != 1:
            loaded = ", ".join(sorted(saes)) or "none; start the engine with --sae NAME=DIR"
            raise ValueError(f"sae: name the SAE to encode with (loaded: {loaded})")
        return next(iter(saes.values()))
    if not isinstance(name, str) or name not in saes:
        loaded = ", ".join(sorted(saes)) or "none; start the engine with --sae NAME=DIR"
        raise ValueError(f"sae: unknown SAE {name!r} (loaded: {loaded})")
    return saes[name]


class SaeFeaturesConsumer(CaptureConsumer):
    name = "sae_features"

    @classmethod
    def validate_options(cls, options: dict[str, Any], engine: EngineFacts) -> dict[str, Any]:
        if unknown := sorted(set(options) - {"sae", "k"}):
            raise ValueError(f"{unknown[0]}: unknown option (sae_features takes sae, k)")
        sae = _sae(options, engine.saes)
        k = options.get("k", min(DEFAULT_K, sae.num_features))
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= sae.num_features:
            raise ValueError(f"k: expected an integer in [1, {sae.num_features}]")
        return {"sae": sae.name, "k": k}

    @classmethod
    def validate_hooks(cls, hooks: Any, options: dict[str, Any], engine: EngineFacts) -> Any:
        sae = _sae(options, engine.saes)
        own = {sae.hook: [sae.layer]}
        if hooks is not None and hooks != own:
            raise ValueError(f"hooks: SAE {sae.name!r} reads {sae.site} "
                             f"({site_name(sae.layer, sae.hook, 'transformer_lens')}); capture only that site "
                             "(or leave hooks out)")
        return own

    def consume(self, capture: RequestCapture) -> dict[str, Any]:
        options = capture.meta.options
        sae = _sae(options, self.context.saes)
        (name, rows), = capture.tensors.items()
        if parse_site_name(name) != (sae.layer, sae.hook):
            raise ValueError(f"captured {name}, but SAE {sae.name!r} reads {sae.site}")
        ids, values = sae.top_features(rows.float().numpy(), options["k"])
        return {"sae": sae.name, "site": name, "positions": capture.meta.positions,
                "feature_ids": ids.tolist(), "feature_values": np.asarray(values, dtype=np.float64).tolist()}

    @classmethod
    def merge_results(cls, results: list[dict[str, Any]]) -> dict[str, Any]:
        """One pipeline stage holds the SAE's layer: its result is the request's."""
        (result,) = results
        return result
