"""Per-step row planning: which rows of the flattened batch each site op touches.

vLLM flattens a step's tokens into one ``[num_tokens, hidden]`` stream: request ``i`` owns rows
``query_start_loc[i]:query_start_loc[i + 1]``, holding positions ``num_computed[i]`` onwards (a chunk of
the prompt, a whole prompt, or one decode token). Row plans are computed on the host from that layout;
rows the plan does not name (other requests, padding) are never read.
"""

from collections.abc import Callable, Container
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class BatchSlice:
    """One request's tokens in a step."""

    req_id: str
    row_start: int
    position_start: int
    num_tokens: int


@dataclass(frozen=True)
class BatchLayout:
    """The step's flattened layout, as arrays (request ``i`` owns ``num_tokens[i]`` rows from
    ``row_starts[i]``, holding positions from ``position_starts[i]``); cheap to build before every step."""

    req_ids: list[str]
    row_starts: np.ndarray
    position_starts: np.ndarray
    num_tokens: np.ndarray

    @classmethod
    def of(cls, req_ids: list[str], query_start_loc: np.ndarray, num_computed: np.ndarray) -> "BatchLayout":
        starts = np.asarray(query_start_loc[: len(req_ids) + 1], dtype=np.int64)
        return cls(req_ids, starts[:-1], np.asarray(num_computed[: len(req_ids)], dtype=np.int64), np.diff(starts))

    def slices(self, only: Container[str] | None = None) -> list[BatchSlice]:
        """The slices of the requests in ``only`` (all when None), in batch order: planners that act on a
        few requests of a large batch build objects for those alone."""
        return [
            BatchSlice(req_id, int(self.row_starts[i]), int(self.position_starts[i]), int(self.num_tokens[i]))
            for i, req_id in enumerate(self.req_ids)
            if only is None or req_id in only
        ]


@dataclass(frozen=True)
class RequestReads:
    """The reads of one request in this step: slots ``slot_start:slot_start + len(positions)``."""

    req_id: str
    slot_start: int
    positions: np.ndarray


@dataclass
class ReadPlan:
    rows: np.ndarray  # token row per slot
    reads: list[RequestReads]

    @property
    def num_rows(self) -> int:
        return int(self.rows.shape[0])


# What a request reads from its slice of a step: every position from this one on (an ``int``: every-token
# capture, planned without a mask), those a boolean mask over the slice's positions picks, or nothing (None).
ReadAnswer = int | np.ndarray | None


def plan_reads(layout: BatchLayout, only: Container[str],
               answer: Callable[[str, int, int], ReadAnswer]) -> ReadPlan:
    """Assign read slots, in batch order, to the rows of the requests in ``only`` that ``answer(req_id,
    position_start, num_tokens)`` picks."""
    position_starts, num_tokens = layout.position_starts.tolist(), layout.num_tokens.tolist()
    row_starts = layout.row_starts.tolist()
    rows: list[np.ndarray] = []
    reads: list[RequestReads] = []
    used = 0
    for i, req_id in enumerate(layout.req_ids):
        if req_id not in only:
            continue
        start, stop = position_starts[i], position_starts[i] + num_tokens[i]
        wanted = answer(req_id, start, num_tokens[i])
        if wanted is None:
            continue
        if isinstance(wanted, np.ndarray):
            positions = np.arange(start, stop)[wanted]
        else:
            positions = np.arange(max(start, wanted), stop)
        if not len(positions):
            continue
        rows.append(positions + (row_starts[i] - start))
        reads.append(RequestReads(req_id, used, positions))
        used += len(positions)
    all_rows = np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)
    return ReadPlan(rows=all_rows.astype(np.int64), reads=reads)


def count_rows(wanted: ReadAnswer, position_start: int, num_tokens: int) -> int:
    """How many rows ``plan_reads`` assigns for one answer about a slice (for deciding before the plan)."""
    if wanted is None:
        return 0
    if isinstance(wanted, np.ndarray):
        return int(np.count_nonzero(wanted))
    return max(0, position_start + num_tokens - max(position_start, wanted))
