"""Causal tracing with PatchStudy: where does the model keep "the Eiffel Tower is in Paris"?

    vllm-interp serve --dtype float32 --enable-patching &
    python examples/patch_study.py --base-url http://localhost:8000 --out eiffel.png

The clean prompt names the Eiffel Tower, the corrupt one the Colosseum (same token length). The server
patches every (layer, token) cell of the corrupt run's residual stream from the clean run, all cells batched
at once, and grades each by how much of the clean answer's logprob comes back (``recovered``: 0 is the
corrupt run, 1 the clean one). The heatmap shows layers up and the corrupt prompt's tokens across.
"""

import argparse

from vllm_interp.client import PatchStudy

CLEAN = "The Eiffel Tower is located in the city of"
CORRUPT = "The Colosseum is located in the city of"


def main(base_url: str, out: str, api_key: str | None = None) -> dict[str, object]:
    with PatchStudy(base_url, api_key=api_key) as study:
        result = study.sweep(CORRUPT, clean_prompt=CLEAN, answer=" Paris", foil=" Rome", hooks=("post_block",),
                             metric="recovered")
        path = result.heatmap(out, title=f"recovered logprob of ' Paris' (vs ' Rome')\nclean: {CLEAN!r}\n"
                                         f"corrupt: {CORRUPT!r}")
        layer, position = result.strongest("post_block")
        # Zoom: the strongest region again, every hook.
        zoom = study.zoom(result, CORRUPT, clean_prompt=CLEAN, hooks=("pre_attn", "post_attn", "post_block"),
                          layers={"start": max(layer - 2, 0), "stop": layer + 3}, positions=[position])
    print(f"wrote {path}; strongest cell: layer {layer}, token {result.tokens[result.positions.index(position)]!r}")
    return {"path": str(path), "strongest": (layer, position), "grid": result.grids["post_block"]["metric"],
            "zoom_layers": zoom.layers, "tokens": result.tokens}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://localhost:8000")
    parser.add_argument("--out", default="patch_study.png")
    parser.add_argument("--api-key", default=None)
    args = parser.parse_args()
    main(args.base_url, args.out, args.api_key)
