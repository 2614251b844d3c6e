"""The ``inline`` consumer: captured rows go back to the caller.

Offline, ``LLM.generate(..., capture={"inline": ...})`` puts them on the output (``output.residuals``): the
tensors travel from the worker as tensors. Over HTTP the non-streaming response carries them in
``capture_results.inline.result.safetensors``: one safetensors blob, base64 (tensors named by site,
``[positions, hidden]``; the capture metadata as JSON in the header under ``vllm_interp``).
"""

import base64
import json
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import load, save

from vllm_interp.capture.consumer import CaptureConsumer, RequestCapture, merge_stages
from vllm_interp.capture.packed import pack, unpack
from vllm_interp.hooks import canonical_hook, parse_site_name, site_name, site_order

METADATA_KEY = "vllm_interp"


@dataclass
class ResidualReadout:
    """Residual rows of one request: ``readout["12.post_block"]`` is a ``[positions, hidden]`` tensor."""

    positions: list[int]
    tensors: dict[str, torch.Tensor]
    metadata: dict[str, Any]

    def __getitem__(self, site: str | tuple[int, str]) -> torch.Tensor:
        if isinstance(site, tuple):
            layer, hook = site
            key = next((n for n in self.tensors if parse_site_name(n) == (layer, canonical_hook(hook))),
                       site_name(layer, hook))
        else:
            key = site
        if key not in self.tensors:
            raise KeyError(f"site {key!r} was not captured; captured sites: {list(self.tensors)}")
        return self.tensors[key]

    @property
    def sites(self) -> list[str]:
        return list(self.tensors)

    def stack(self, hook: str) -> torch.Tensor:
        """``[layers, positions, hidden]`` for one hook (either spelling), in layer order."""
        wanted = canonical_hook(hook)
        names = [name for name in self.tensors if parse_site_name(name)[1] == wanted]
        if not names:
            raise KeyError(f"hook {hook!r} was not captured")
        return torch.stack([self.tensors[name] for name in names])

    def to_bytes(self) -> bytes:
        return save(self.tensors, metadata={METADATA_KEY: json.dumps(self.metadata)})

    @classmethod
    def from_bytes(cls, blob: bytes) -> "ResidualReadout":
        tensors = load(blob)
        metadata = json.loads(_header_metadata(blob).get(METADATA_KEY, "{}"))
        ordered = {name: tensors[name] for name in sorted(tensors, key=site_order)}
        return cls(positions=list(metadata.get("positions", [])), tensors=ordered, metadata=metadata)

    @classmethod
    def from_result(cls, result: dict[str, Any]) -> "ResidualReadout":
        """From the inline consumer's result: tensors (offline) or the base64 safetensors blob (HTTP)."""
        if "safetensors" in result:
            return cls.from_bytes(base64.b64decode(result["safetensors"]))
        metadata = result["metadata"]
        block = unpack(result["rows"])
        return cls(list(metadata["positions"]), dict(zip(metadata["sites"], block.unbind(0), strict=True)), metadata)

    def to_result(self) -> dict[str, Any]:
        """One ``[sites, positions, hidden]`` block, packed (``capture.packed``): one copy however many sites."""
        block = torch.stack(list(self.tensors.values())) if self.tensors else torch.empty(0)
        metadata = {**self.metadata, "sites": list(self.tensors), "dtype": str(block.dtype).removeprefix("torch.")}
        return {"metadata": metadata, "rows": pack(block)}


def _header_metadata(blob: bytes) -> dict[str, str]:
    size = int.from_bytes(blob[:8], "little")
    return json.loads(blob[8 : 8 + size]).get("__metadata__", {})


class InlineConsumer(CaptureConsumer):
    name = "inline"

    def consume(self, capture: RequestCapture) -> dict[str, Any]:
        return ResidualReadout(capture.meta.positions, capture.tensors, capture.meta.to_json()).to_result()

    @classmethod
    def merge_results(cls, results: list[dict[str, Any]]) -> dict[str, Any]:
        """Pipeline stages each return their own layers: one blob with all of them."""
        parts = [ResidualReadout.from_result(r) for r in results]
        tensors, metadata = merge_stages([(part.tensors, part.metadata) for part in parts])
        return ResidualReadout(parts[0].positions, tensors, metadata).to_result()

    @classmethod
    def result_to_json(cls, result: dict[str, Any]) -> dict[str, Any]:
        blob = ResidualReadout.from_result(result).to_bytes()
        return {"safetensors": base64.b64encode(blob).decode("ascii")}
