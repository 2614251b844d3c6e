"""Named steering vectors from files (``--steering-vectors name=path``).

- ``.safetensors``: one tensor per site, named ``"{layer}.{hook}"`` (shape ``[hidden]``), base tier;
- ``.json``: the body of ``POST /v1/steering/vectors/register`` without ``name``
  (``vectors``, ``prefill_vectors``, ``decode_vectors``).
"""

import json
from pathlib import Path
from typing import Any

from vllm_interp.hooks import parse_site_name
from vllm_interp.steering.state import check_vector_name
from vllm_interp.steering.vectors import SteeringError


def parse_named_file(flag: str) -> tuple[str, Path]:
    name, sep, path = flag.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--steering-vectors {flag!r}: expected NAME=PATH")
    try:
        check_vector_name(name, "NAME")
    except SteeringError as exc:
        raise ValueError(f"--steering-vectors {exc}") from None
    if not Path(path).is_file():
        raise ValueError(f"--steering-vectors {flag!r}: no such file {path}")
    return name, Path(path)


def load_named_file(path: Path) -> dict[str, Any]:
    """The register spec (``vectors``/``prefill_vectors``/``decode_vectors``) stored in ``path``."""
    if path.suffix == ".safetensors":
        from safetensors.numpy import load_file

        vectors: dict[str, dict[str, list[float]]] = {}
        for name, array in load_file(str(path)).items():
            layer, hook = parse_site_name(name)
            vectors.setdefault(hook, {})[str(layer)] = array.astype("float32").tolist()
        return {"vectors": vectors}
    if path.suffix == ".json":
        spec = json.loads(path.read_text())
        unknown = set(spec) - {"vectors", "prefill_vectors", "decode_vectors"}
        if unknown:
            raise ValueError(f"{path}: unknown keys {sorted(unknown)}")
        return spec
    raise ValueError(f"{path}: steering vector files are .safetensors or .json")
