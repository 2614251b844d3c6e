"""The ``logging`` consumer: per-position summary statistics of every captured row, logged and returned.

Enable with ``--capture-consumers logging[:level=debug,max_positions=4]``. For each request it logs one line
per site (logger ``vllm_interp.capture.logging``) and returns the statistics as the request's result::

    {"rows": 6, "stats": {"12.post_block": {"norm": [...], "mean": [...], "std": [...], "min": [...],
                                            "max": [...]}}}

Every list has one float per captured position, in ``meta.positions`` order. ``std`` is the population
standard deviation over the hidden dimension. A request may ask for ``"format": "packed"`` instead (for
harvesting: no float text to write or parse): ``{"rows", "sites", "statistics": STATS, "stats"}`` with
``stats`` a ``[sites, positions, statistics]`` float32 tensor offline, over HTTP ``{"dtype", "shape",
"data"}`` with the little-endian bytes in base64. The statistics are computed in float32 on the rows' device
during each step (the consumer's ``row_reduction``): every-token capture to ``logging`` moves five floats
per row off the GPU, not the row. They travel back packed (``capture.packed``: one buffer, not 41,000 Python
floats for 512 positions at 16 sites) and become lists on the caller's side (``result_from_wire``).
"""

import logging
import math
from typing import Any, ClassVar

import pybase64
import torch

from vllm_interp.capture.consumer import CaptureConsumer, ConsumerContext, EngineFacts, RequestCapture, RowReduction
from vllm_interp.capture.packed import pack, unpack

logger = logging.getLogger("vllm_interp.capture.logging")

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING}
DEFAULT_OPTIONS: dict[str, Any] = {"level": "info", "max_positions": 16}
STATS = ("norm", "mean", "std", "min", "max")
FORMATS = ("lists", "packed")


def row_statistics(rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``[..., len(STATS)]`` float32: each row's statistics over the hidden dimension, in ``STATS`` order
    (written into ``out`` where given). Runs on the rows' device during the step (the consumer's
    ``row_reduction``): on a GPU in one kernel launch (``statistics_kernel``), elsewhere in torch."""
    if rows.is_cuda:
        from vllm_interp.capture.consumers.statistics_kernel import row_statistics_kernel

        return row_statistics_kernel(rows, len(STATS), out)
    return torch_row_statistics(rows, out)


def torch_row_statistics(rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``row_statistics`` in torch operations, on any device (into ``out`` where given)."""
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
    ], dim=-1, out=out)


def stats_lists(stats: torch.Tensor) -> dict[str, list[float]]:
    """``[positions, len(STATS)]`` statistics as one list per statistic."""
    return dict(zip(STATS, stats.T.tolist(), strict=True)) if len(stats) else {key: [] for key in STATS}


# The same function reduces into a block of steps (``reduce_into``): it takes the output as its second argument.
ROW_STATISTICS = RowReduction("statistics", len(STATS), row_statistics, row_statistics)


class LoggingConsumer(CaptureConsumer):
    """Logs and returns per-position norm/mean/std/min/max of every captured site."""

    name: ClassVar[str] = "logging"
    # The statistics are reduced on the device: packing them (and a few log lines) costs less than handing a
    # request to another process, whose every system call waits for the worker's interpreter lock behind the
    # forward loop (64 every-token requests on the dev CPU with a busy forward thread: 223 ms to the median
    # result through a process, 86 ms on the thread).
    default_isolation: ClassVar[str] = "thread"
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

    @classmethod
    def validate_options(cls, options: dict[str, Any], engine: EngineFacts) -> dict[str, Any]:
        """A request may set ``format`` (``lists``, the default, or ``packed``)."""
        unknown = sorted(set(options) - {"format"})
        if unknown:
            raise ValueError(f"{unknown[0]}: unknown option (known: format)")
        if options.get("format", "lists") not in FORMATS:
            raise ValueError(f"format: expected one of {', '.join(FORMATS)}, got {options['format']!r}")
        return dict(options)

    def consume(self, capture: RequestCapture) -> dict[str, Any]:
        meta = capture.meta
        # The formatting is the costly part for wide captures; skip it when the level is filtered out.
        if logger.isEnabledFor(self.level):
            head = f"request {meta.request_id}" + (f" tag={meta.tag}" if meta.tag else "")
            for site, site_stats in capture:
                logger.log(self.level, "%s %s: %s", head, site, self._format(meta.positions, site_stats))
        # The block the sites' tensors are views of is already [sites, positions, statistics]: no stacking anew.
        if capture.block is not None:
            stats = capture.block
        else:
            stats = torch.stack([capture.tensors[site] for site in meta.sites]) if meta.sites else torch.empty(0, 0, 0)
        return {"rows": len(meta.positions) * len(meta.sites), "sites": meta.sites, "stats": pack(stats),
                "format": meta.options.get("format", "lists")}

    @classmethod
    def result_from_wire(cls, result: dict[str, Any]) -> dict[str, Any]:
        """The packed ``[sites, positions, statistics]`` block as the request's format asks: one list per
        statistic per site, or the tensor."""
        stats = unpack(result["stats"])
        if result["format"] == "packed":
            return {"rows": result["rows"], "sites": result["sites"], "statistics": list(STATS), "stats": stats}
        return {"rows": result["rows"],
                "stats": {site: stats_lists(site_stats) for site, site_stats in zip(result["sites"], stats,
                                                                                     strict=True)}}

    @classmethod
    def merge_results(cls, results: list[dict[str, Any]]) -> dict[str, Any]:
        """Pipeline stages each return their own layers' sites: one result with all of them, in stage order."""
        rows = sum(r["rows"] for r in results)
        if "sites" in results[0]:  # packed
            return {"rows": rows, "sites": [site for r in results for site in r["sites"]],
                    "statistics": list(STATS), "stats": torch.cat([r["stats"] for r in results])}
        return {"rows": rows, "stats": {site: values for r in results for site, values in r["stats"].items()}}

    @classmethod
    def result_to_json(cls, result: dict[str, Any]) -> dict[str, Any]:
        """Lists as they are; a packed result's tensor as ``{"dtype", "shape", "data"}`` (base64)."""
        if "sites" not in result:
            return result
        packed = pack(result["stats"])
        return {**result, "stats": {**packed, "data": pybase64.b64encode_as_string(packed["data"])}}

    def _format(self, positions: list[int], stats: torch.Tensor) -> str:
        if not positions:
            return "no positions captured"
        shown = [
            f"[{pos}] " + " ".join(f"{key}={value:.4g}" for key, value in zip(STATS, values, strict=True))
            for pos, values in zip(positions[: self.max_positions], stats[: self.max_positions].tolist(), strict=True)
        ]
        omitted = len(positions) - len(shown)
        return " | ".join(shown) + (f" (+{omitted} positions omitted)" if omitted else "")
