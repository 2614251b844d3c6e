"""The ``logging`` consumer: per-position summary statistics of every captured row, logged and returned.

Enable with ``--capture-consumers logging[:level=debug,max_positions=4]``. For each request it logs one line
per site (logger ``vllm_interp.capture.logging``) and returns the statistics as the request's result::

    {"rows": 6, "stats": {"12.post_block": {"norm": [...], "mean": [...], "std": [...], "min": [...],
                                            "max": [...]}}}

Every list has one float per captured position, in ``meta.positions`` order. ``std`` is the population
standard deviation over the hidden dimension. The statistics are computed in float32 on the rows' device
during each step (the consumer's ``row_reduction``): every-token capture to ``logging`` moves five floats
per row off the GPU, not the row.
"""

import logging
import math
from typing import Any, ClassVar

import torch

from vllm_interp.capture.consumer import CaptureConsumer, ConsumerContext, RequestCapture, RowReduction

logger = logging.getLogger("vllm_interp.capture.logging")

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING}
DEFAULT_OPTIONS: dict[str, Any] = {"level": "info", "max_positions": 16}
STATS = ("norm", "mean", "std", "min", "max")


def row_statistics(rows: torch.Tensor) -> torch.Tensor:
    """``[..., len(STATS)]`` float32: each row's statistics over the hidden dimension, in ``STATS`` order.
    Runs on the rows' device during the step (the consumer's ``row_reduction``)."""
    # Half-precision reductions over thousands of elements would blur the very numbers this summary shows.
    rows = rows.float()
    mean = rows.mean(dim=-1)
    # Two passes (the norm of the centred rows) instead of torch.std, and amin/amax instead of aminmax: the
    # same numbers to float rounding, and 5x faster on a CPU thread.
    return torch.stack([
        torch.linalg.vector_norm(rows, dim=-1),
        mean,
        torch.linalg.vector_norm(rows - mean[..., None], dim=-1) / math.sqrt(rows.shape[-1]),
        rows.amin(dim=-1),
        rows.amax(dim=-1),
    ], dim=-1)


def stats_lists(stats: torch.Tensor) -> dict[str, list[float]]:
    """``[positions, len(STATS)]`` statistics as one list per statistic."""
    return dict(zip(STATS, stats.T.tolist(), strict=True)) if len(stats) else {key: [] for key in STATS}


ROW_STATISTICS = RowReduction("statistics", len(STATS), row_statistics)


class LoggingConsumer(CaptureConsumer):
    """Logs and returns per-position norm/mean/std/min/max of every captured site."""

    name: ClassVar[str] = "logging"
    default_isolation: ClassVar[str] = "process"  # formatting every row's statistics is CPU work
    # The statistics are computed on the device as each step runs: the rows themselves never leave it.
    row_reduction: ClassVar[RowReduction | None] = ROW_STATISTICS

    def __init__(self, context: ConsumerContext) -> None:
        super().__init__(context)
        self.level = LEVELS[context.options["level"]]
        self.max_positions = context.options["max_positions"]

    @classmethod
    def validate_engine_options(cls, options: dict[str, str]) -> dict[str, Any]:
        unknown = sorted(set(options) - set(DEFAULT_OPTIONS))
        if unknown:
            raise ValueError(f"{unknown[0]}: unknown option (known: {', '.join(DEFAULT_OPTIONS)})")
        merged = {**DEFAULT_OPTIONS, **options}
        level = str(merged["level"]).lower()
        if level not in LEVELS:
            raise ValueError(f"level: expected one of {', '.join(LEVELS)}, got {merged['level']!r}")
        try:
            max_positions = int(merged["max_positions"])
        except ValueError:
            raise ValueError(f"max_positions: expected an integer, got {merged['max_positions']!r}") from None
        if max_positions < 1:
            raise ValueError(f"max_positions: must be at least 1, got {max_positions}")
        return {"level": level, "max_positions": max_positions}

    def consume(self, capture: RequestCapture) -> dict[str, Any]:
        meta = capture.meta
        stats = {site: stats_lists(site_stats) for site, site_stats in capture}
        # The formatting is the costly part for wide captures; skip it when the level is filtered out.
        if logger.isEnabledFor(self.level):
            head = f"request {meta.request_id}" + (f" tag={meta.tag}" if meta.tag else "")
            for site, site_stats in stats.items():
                logger.log(self.level, "%s %s: %s", head, site, self._format(meta.positions, site_stats))
        return {"rows": len(meta.positions) * len(stats), "stats": stats}

    def _format(self, positions: list[int], stats: dict[str, list[float]]) -> str:
        if not positions:
            return "no positions captured"
        shown = [
            f"[{pos}] " + " ".join(f"{key}={values[i]:.4g}" for key, values in stats.items())
            for i, pos in enumerate(positions[: self.max_positions])
        ]
        omitted = len(positions) - len(shown)
        return " | ".join(shown) + (f" (+{omitted} positions omitted)" if omitted else "")
