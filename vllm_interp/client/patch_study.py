"""``PatchStudy``: causal tracing against a `vllm-interp serve` server, from Python.

Capture a clean run, sweep a corrupt prompt against it (server-side, streamed, with a progress bar), zoom
into a region, run ablation sweeps; results come back as numpy arrays and as a heatmap (layers x tokens,
labelled with the prompt's tokens, the answer and foil in the title). Needs the ``client`` extra
(``pip install "vllm-interp[client]"``): httpx and httpx-sse, numpy, tqdm, matplotlib.
"""

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from httpx_sse import connect_sse
from tqdm import tqdm

GRIDS = ("answer_logprob", "foil_logprob", "metric")


class SweepFailed(RuntimeError):
    """The server refused the sweep or reported an error event."""


@dataclass
class SweepResult:
    """One sweep: per hook, ``[layers, positions]`` arrays of each grid (NaN where a cell failed)."""

    layers: list[int]
    positions: list[int]
    tokens: list[str]  # the corrupt prompt's tokens at ``positions``
    hooks: list[str]
    metric: str
    grids: dict[str, dict[str, np.ndarray]]
    clean: dict[str, float] | None
    corrupt: dict[str, float]
    answer_token_id: int
    foil_token_id: int | None
    errors: list[dict[str, Any]] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_summary(cls, summary: dict[str, Any]) -> "SweepResult":
        grids = {hook: {name: np.array([[np.nan if v is None else v for v in row] for row in grid[name]], dtype=float)
                        for name in GRIDS} for hook, grid in summary["grids"].items()}
        return cls(summary["layers"], summary["positions"], summary["tokens"], summary["hooks"], summary["metric"],
                   grids, summary["clean"], summary["corrupt"], summary["answer_token_id"], summary["foil_token_id"],
                   summary["errors"], summary)

    def strongest(self, hook: str) -> tuple[int, int]:
        """(layer, position) of the cell with the largest metric."""
        grid = self.grids[hook]["metric"]
        row, col = np.unravel_index(np.nanargmax(grid), grid.shape)
        return self.layers[row], self.positions[col]

    def heatmap(self, path: str | Path, hook: str | None = None, title: str | None = None) -> Path:
        """Write a PNG of the metric grid: layers up, tokens across."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        hooks = [hook] if hook else self.hooks
        fig, axes = plt.subplots(1, len(hooks), figsize=(1.2 + 0.7 * len(self.positions) * len(hooks), 7),
                                 squeeze=False)
        for ax, name in zip(axes[0], hooks, strict=True):
            image = ax.imshow(self.grids[name]["metric"], aspect="auto", origin="lower", cmap="viridis")
            ax.set_xticks(range(len(self.tokens)), [t.replace("Ġ", " ").replace("Ċ", "\\n") for t in self.tokens],
                          rotation=60, ha="right")
            ax.set_yticks(range(len(self.layers)), [str(layer) for layer in self.layers])
            ax.set_xlabel("corrupt prompt token")
            ax.set_ylabel("layer")
            ax.set_title(name)
            fig.colorbar(image, ax=ax, label=self.metric)
        fig.suptitle(title or self.raw.get("title") or f"{self.metric}: answer {self.answer_token_id}"
                     + (f" vs foil {self.foil_token_id}" if self.foil_token_id is not None else ""))
        fig.tight_layout()
        path = Path(path)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path


class PatchStudy:
    """A causal-tracing session against one server (``base_url`` like ``http://localhost:8000``)."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 600.0) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> "PatchStudy":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def capture(self, prompt: str | list[int], run_id: str | None = None, hooks: Any = "all") -> str:
        """Store ``prompt``'s residual rows (every prompt position) as a source run; returns its id."""
        spec = {"hooks": hooks, "positions": "all_prompt", **({"tag": run_id} if run_id else {})}
        reply = self._post("/v1/completions", {"prompt": prompt, "max_tokens": 1, "capture": {"patch_source": spec}})
        result = reply["capture_results"]["patch_source"]
        if result["status"] != "ok":
            raise SweepFailed(f"capture failed: {result['message']}")
        return result["result"]["run_id"]

    def sources(self) -> list[dict[str, Any]]:
        return self._check(self.http.get("/v1/patch_sources")).json()["runs"]

    def delete(self, run_id: str) -> None:
        self._check(self.http.delete(f"/v1/patch_sources/{run_id}"))

    def sweep(self, prompt: str | list[int], *, answer: str | int, foil: str | int | None = None,
              clean_prompt: str | list[int] | None = None, source_run: str | None = None,
              hooks: tuple[str, ...] = ("pre_attn", "post_block"), layers: Any = "all", positions: Any = "all_prompt",
              metric: str = "logprob", alpha: float = 1.0, ablate: bool = False, progress: bool = True) -> SweepResult:
        """Patch every (hook, layer, position) cell of ``prompt`` from the clean run (or ablate it to zeros),
        streamed from the server with a progress bar."""
        body: dict[str, Any] = {"prompt": prompt, "hooks": list(hooks), "layers": layers, "positions": positions,
                                "metric": metric, "alpha": alpha, "stream": True}
        body.update(_token("answer_token", answer))
        if foil is not None:
            body.update(_token("foil_token", foil))
        if ablate:
            body["ablate"] = True
        elif clean_prompt is not None:
            body["clean_prompt"] = clean_prompt
        else:
            body["source_run"] = source_run
        summary, bar = None, None
        with connect_sse(self.http, "POST", "/v1/patch_sweep", json=body) as source:
            if source.response.status_code != 200:
                source.response.read()
                self._check(source.response)
            for event in source.iter_sse():
                data = json.loads(event.data)
                if event.event == "start":
                    bar = tqdm(total=data["num_cells"], desc="patch sweep", unit="cell", disable=not progress)
                elif event.event == "cell" and bar is not None:
                    bar.update(1)
                elif event.event == "summary":
                    summary = data
                elif event.event == "error":
                    raise SweepFailed(data["error"]["message"])
        if bar is not None:
            bar.close()
        if summary is None:
            raise SweepFailed("the server closed the stream before the summary")
        return SweepResult.from_summary(summary)

    def zoom(self, result: SweepResult, prompt: str | list[int], *, layers: Any, positions: Any,
             **kwargs: Any) -> SweepResult:
        """The same sweep over a sub-grid (e.g. around ``result.strongest(hook)``)."""
        answer = kwargs.pop("answer", result.answer_token_id)
        foil = kwargs.pop("foil", result.foil_token_id)
        return self.sweep(prompt, answer=answer, foil=foil, layers=layers, positions=positions,
                          metric=kwargs.pop("metric", result.metric), **kwargs)

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return self._check(self.http.post(path, json=body)).json()

    @staticmethod
    def _check(response: httpx.Response) -> httpx.Response:
        if response.status_code >= 400:
            try:
                message = response.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = response.text
            raise SweepFailed(f"HTTP {response.status_code}: {message}")
        return response


def _token(name: str, value: str | int) -> dict[str, Any]:
    return {f"{name}_id": value} if isinstance(value, int) else {name: value}
