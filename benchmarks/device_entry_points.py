"""Make vllm-interp's entry points visible without installing it (the lent GPU machine has no network).

vLLM finds its plugins, and vllm-interp its capture consumers, through package entry points, which live in
an installed distribution's metadata. This writes that metadata (from pyproject.toml) into DIR; put DIR and
the repository root on PYTHONPATH.

    python benchmarks/device_entry_points.py DIR

``tests/gpu/run-on-device`` uses it: it has worked on the device, where ``pip install -e .`` (which needs the
setuptools that pyproject.toml names) has not been tried.
"""

import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def write_dist_info(target: Path) -> Path:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    dist_info = target / f"vllm_interp-{project['version']}.dist-info"
    dist_info.mkdir(parents=True, exist_ok=True)
    metadata = f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n"
    (dist_info / "METADATA").write_text(metadata)
    groups = [f"[{group}]\n" + "".join(f"{name} = {value}\n" for name, value in entries.items())
              for group, entries in project["entry-points"].items()]
    (dist_info / "entry_points.txt").write_text("\n".join(groups))
    return dist_info


if __name__ == "__main__":
    print(write_dist_info(Path(sys.argv[1])))
