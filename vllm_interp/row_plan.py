"""Per-step row planning: which rows of the flattened batch each site op touches.

vLLM flattens a step's tokens into one ``[num_tokens, hidden]`` stream: request ``i`` owns rows
``query_start_loc[i]:query_start_loc[i + 1]``, holding positions ``num_computed[i]`` onwards (a chunk of
the prompt, a whole prompt, or one decode token). Row plans are computed on the host from that layout;
rows the plan does not name (other requests, padding) are never read.
"""

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class BatchSlice:
    """One request's tokens in a step."""

    req_id: str
    row_start: int
    position_start: int
    num_tokens: int

    @property
    def positions(self) -> np.ndarray:
        return np.arange(self.position_start, self.position_start + self.num_tokens)


def batch_slices(req_ids: list[str], query_start_loc: np.ndarray, num_computed: np.ndarray) -> list[BatchSlice]:
    return [
        BatchSlice(
            req_id=req_id,
            row_start=int(query_start_loc[i]),
            position_start=int(num_computed[i]),
            num_tokens=int(query_start_loc[i + 1] - query_start_loc[i]),
        )
        for i, req_id in enumerate(req_ids)
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


def plan_reads(slices: list[BatchSlice], selector: Callable[[str, np.ndarray], np.ndarray | None]) -> ReadPlan:
    """Assign read slots, in batch order, to the rows whose positions ``selector`` picks.

    ``selector(req_id, positions)`` returns a boolean mask over ``positions`` (None: the request reads
    nothing).
    """
    rows: list[np.ndarray] = []
    reads: list[RequestReads] = []
    used = 0
    for batch_slice in slices:
        positions = batch_slice.positions
        mask = selector(batch_slice.req_id, positions)
        if mask is None or not mask.any():
            continue
        wanted = positions[mask]
        rows.append(batch_slice.row_start + (wanted - batch_slice.position_start))
        reads.append(RequestReads(batch_slice.req_id, used, wanted))
        used += len(wanted)
    all_rows = np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)
    return ReadPlan(rows=all_rows.astype(np.int64), reads=reads)
