"""Per-step row planning: which rows of the flattened batch each site op touches.

vLLM flattens a step's tokens into one ``[num_tokens, hidden]`` stream: request ``i`` owns rows
``query_start_loc[i]:query_start_loc[i + 1]``, holding positions ``num_computed[i]`` onwards (a chunk of
the prompt, a whole prompt, or one decode token). Row plans are computed on the host from that layout;
rows the plan does not name (other requests, padding) are never read.
"""

from collections.abc import Container, Mapping
from dataclasses import dataclass
from functools import cached_property

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
        # A subtraction, not np.diff, whose Python wrapper costs four times as much (built before every step).
        return cls(req_ids, starts[:-1], np.asarray(num_computed[: len(req_ids)], dtype=np.int64),
                   starts[1:] - starts[:-1])

    @property
    def total_tokens(self) -> int:
        return int(self.row_starts[-1] + self.num_tokens[-1]) if self.req_ids else 0

    def slices(self, only: Container[str] | None = None) -> list[BatchSlice]:
        """The slices of the requests in ``only`` (all when None), in batch order: planners that act on a
        few requests of a large batch build objects for those alone."""
        if only is not None and not only:
            return []
        return [
            BatchSlice(req_id, int(self.row_starts[i]), int(self.position_starts[i]), int(self.num_tokens[i]))
            for i, req_id in enumerate(self.req_ids)
            if only is None or req_id in only
        ]


@dataclass
class ReadPlan:
    """The rows a step reads, in slots: request ``req_ids[k]`` owns slots ``slot_starts[k]:slot_starts[k + 1]``
    (only requests that read take slots). Arrays, not per-request objects: an every-token capture plans a row
    for every request of every decode step."""

    rows: np.ndarray  # token row per slot
    positions: np.ndarray  # token position per slot
    req_ids: list[str]
    slot_starts: np.ndarray  # len(req_ids) + 1 offsets

    @property
    def num_rows(self) -> int:
        return int(self.rows.shape[0])

    @cached_property
    def _bounds(self) -> list[int]:
        # Python ints: a request's rows are gathered from one slice per step filed for it (up to 512 for an
        # every-token request of 512 positions), and indexing the array for each bound costs several times more.
        return self.slot_starts.tolist()

    def positions_of(self, k: int) -> np.ndarray:
        bounds = self._bounds
        return self.positions[bounds[k] : bounds[k + 1]]

    def splits(self) -> list[tuple[int, int]]:
        """Each reading request's ``(first slot, end slot)``, in ``req_ids`` order."""
        bounds = self._bounds
        return list(zip(bounds[:-1], bounds[1:], strict=True))


NO_READS = ReadPlan(rows=np.empty(0, np.int64), positions=np.empty(0, np.int64), req_ids=[],
                    slot_starts=np.zeros(1, np.int64))  # a step that reads nothing (shared: nothing changes it)

# What a request reads from its slice of a step: every position from this one on (an ``int``: every-token
# capture, planned without a mask), those a boolean mask over the slice's positions picks, or nothing (None).
ReadAnswer = int | np.ndarray | None
NEVER = np.iinfo(np.int64).max  # a first position no slice reaches


def plan_reads(layout: BatchLayout, answers: Mapping[int, ReadAnswer]) -> ReadPlan:
    """Assign read slots, in batch order, to the rows that ``answers[i]`` picks from the slice of request ``i``
    of the batch (a request without an answer reads nothing). Vectorised over the step's tokens."""
    if not answers:  # most steps of most engines
        return NO_READS
    count = len(layout.req_ids)
    first = np.full(count, NEVER, dtype=np.int64)
    masks = {}
    for i, answer in answers.items():
        if isinstance(answer, np.ndarray):
            masks[i] = answer
        elif answer is not None:
            first[i] = answer
    num_tokens = layout.num_tokens
    slice_starts = np.cumsum(num_tokens) - num_tokens  # each slice's first token among the step's tokens
    owner = np.repeat(np.arange(count), num_tokens)  # batch index of each of the step's tokens
    offset = np.arange(len(owner)) - slice_starts[owner]  # each token's place in its slice
    positions = layout.position_starts[owner] + offset
    picked = positions >= first[owner]
    for i, mask in masks.items():
        picked[slice_starts[i] : slice_starts[i] + num_tokens[i]] = mask
    tokens = np.flatnonzero(picked)
    per_request = np.bincount(owner[tokens], minlength=count)
    readers = np.flatnonzero(per_request)
    return ReadPlan(rows=(layout.row_starts[owner] + offset)[tokens].astype(np.int64), positions=positions[tokens],
                    req_ids=[layout.req_ids[i] for i in readers],
                    slot_starts=np.concatenate([[0], np.cumsum(per_request[readers])]).astype(np.int64))


def count_rows(wanted: ReadAnswer, position_start: int, num_tokens: int) -> int:
    """How many rows ``plan_reads`` assigns for one answer about a slice (for deciding before the plan)."""
    if wanted is None:
        return 0
    if isinstance(wanted, np.ndarray):
        return int(np.count_nonzero(wanted))
    return max(0, position_start + num_tokens - max(position_start, wanted))
