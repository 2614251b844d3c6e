"""The ``inline`` consumer: captured rows go back to the caller.

Offline, ``LLM.generate(..., capture={"inline": ...})`` puts them on the output (``output.residuals``): the
tensors travel from the worker as tensors. Over HTTP the non-streaming response carries them in
``capture_results.inline.result.safetensors``: one safetensors blob, base64 (tensors named by site,
``[positions, hidden]``; the capture metadata as JSON in the header under ``vllm_interp``).
"""

import json
from dataclasses import dataclass
from typing import Any

import pybase64
import torch
from safetensors.torch import load

from vllm_interp.capture.consumer import CaptureConsumer, RequestCapture, merge_stages
from vllm_interp.capture.packed import pack, unpack
from vllm_interp.hooks import canonical_hook, parse_site_name, site_name, site_order

METADATA_KEY = "vllm_interp"
# safetensors' names for the dtypes a residual stream comes in.
SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float64": "F64"}


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
            return cls.from_bytes(pybase64.b64decode(result["safetensors"]))
        metadata = result["metadata"]
        block = unpack(result["rows"])
        return cls(list(metadata["positions"]), dict(zip(metadata["sites"], block.unbind(0), strict=True)), metadata)

    def to_result(self, block: torch.Tensor | None = None) -> dict[str, Any]:
        """One ``[sites, positions, hidden]`` block, packed (``capture.packed``): one copy however many sites.
        ``block``: the tensors already stacked in that order (a capture's block), taken as is."""
        if block is None:
            block = torch.stack(list(self.tensors.values())) if self.tensors else torch.empty(0)
        metadata = {**self.metadata, "sites": list(self.tensors), "dtype": str(block.dtype).removeprefix("torch.")}
        return {"metadata": metadata, "rows": pack(block)}


def _header_metadata(blob: bytes) -> dict[str, str]:
    size = int.from_bytes(blob[:8], "little")
    return json.loads(blob[8 : 8 + size]).get("__metadata__", {})


class InlineConsumer(CaptureConsumer):
    name = "inline"

    def consume(self, capture: RequestCapture) -> dict[str, Any]:
        readout = ResidualReadout(capture.meta.positions, capture.tensors, capture.meta.to_json())
        return readout.to_result(capture.block)

    @classmethod
    def merge_results(cls, results: list[dict[str, Any]]) -> dict[str, Any]:
        """Pipeline stages each return their own layers: one blob with all of them."""
        parts = [ResidualReadout.from_result(r) for r in results]
        tensors, metadata = merge_stages([(part.tensors, part.metadata) for part in parts])
        return ResidualReadout(parts[0].positions, tensors, metadata).to_result()

    @classmethod
    def result_to_json(cls, result: dict[str, Any]) -> dict[str, Any]:
        return {"safetensors": pybase64.b64encode_as_string(safetensors_blob(result))}


def safetensors_blob(result: dict[str, Any]) -> bytes:
    """The safetensors file of an inline result (``to_result``'s form), written directly: its rows are one
    ``[sites, positions, hidden]`` block already, which is the file's data section as it is, each site's tensor
    one slice of it. safetensors' own ``save`` spends about 1 ms of Python on 48 tensors, per request on the
    API server's one event loop; this is a header and one join."""
    metadata, rows = result["metadata"], result["rows"]
    sites, data = metadata["sites"], rows["data"]
    header: dict[str, Any] = {"__metadata__": {METADATA_KEY: json.dumps(metadata)}}
    if sites:
        size = len(data) // len(sites)
        dtype = SAFETENSORS_DTYPES[rows["dtype"]]
        for i, site in enumerate(sites):
            header[site] = {"dtype": dtype, "shape": rows["shape"][1:], "data_offsets": [i * size, (i + 1) * size]}
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # as safetensors writes it: the data section starts 8-byte aligned
    return len(encoded).to_bytes(8, "little") + encoded + data
