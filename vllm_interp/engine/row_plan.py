"""Per-step row planning: which rows of the flattened batch each site op touches.

vLLM flattens a step's tokens into one ``[num_tokens, hidden]`` stream: request ``i`` owns rows
``query_start_loc[i]:query_start_loc[i + 1]``, holding positions ``num_computed[i]`` onwards (a chunk of
the prompt, a whole prompt, or one decode token). Row plans are computed on the host from that layout
and copied into the persistent ``rows`` buffer; slots past the plan keep stale indices, which the op
ignores (it reads only the planned count), so padded rows are no-ops.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

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
    overflow: dict[str, int] = field(default_factory=dict)  # req_id -> rows that did not fit

    @property
    def num_rows(self) -> int:
        return int(self.rows.shape[0])


def plan_reads(
    slices: list[BatchSlice], selector: Callable[[str, np.ndarray], np.ndarray | None], capacity: int
) -> ReadPlan:
    """Assign read slots, in batch order, to the rows whose positions ``selector`` picks.

    ``selector(req_id, positions)`` returns a boolean mask over ``positions`` (None: the request reads
    nothing). Rows beyond ``capacity`` are not read and are counted in ``overflow`` so that the request
    fails loudly instead of returning a partial read-out.
    """
    rows: list[np.ndarray] = []
    reads: list[RequestReads] = []
    overflow: dict[str, int] = {}
    used = 0
    for batch_slice in slices:
        positions = batch_slice.positions
        mask = selector(batch_slice.req_id, positions)
        if mask is None or not mask.any():
            continue
        wanted = positions[mask]
        fit = min(len(wanted), capacity - used)
        if fit < len(wanted):
            overflow[batch_slice.req_id] = len(wanted) - fit
        if fit == 0:
            continue
        wanted = wanted[:fit]
        rows.append(batch_slice.row_start + (wanted - batch_slice.position_start))
        reads.append(RequestReads(batch_slice.req_id, used, wanted))
        used += fit
    all_rows = np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)
    return ReadPlan(rows=all_rows.astype(np.int64), reads=reads, overflow=overflow)
