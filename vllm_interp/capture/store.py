"""Worker side of capture: rows gathered after each step, handed to consumers when a request finishes.

Rows are kept by absolute position, so chunked prefill spreads a request's rows over steps and a preempted
request that is recomputed overwrites the positions it already had: consumers see each position once. A
request ends when the caller asks for its results (``results``, by capture key, with the final sequence
length), when the scheduler reports it finished (``finish``: aborts, streaming requests, global captures), or,
when its specs read only prompt positions, with the step that read its last prompt rows (``collect``);
whichever comes first. It is then finalized (handed to its consumers) as soon as the copies of
its steps have landed in host memory, which the forward thread never waits for: waiting for a second of
whole rows in flight would stall every request of the engine at each finish (measured on an H100).

A request whose consumers all take parts (``CaptureConsumer.part_bytes``) is handed on in parts while it runs:
whenever its landed rows reach the part size, every landed step but the newest goes to its consumers, so its
rows leave the worker as they are computed. The newest step stays for the next part: it may be a step that ran
past the request's end (an asynchronous scheduler's), which only the final length rules out. A position handed
on in a part is never handed on again, even if a preempted request computes it anew.
"""

import itertools
import logging
import threading
import time
from collections.abc import Callable, Container, Iterable, Mapping
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import Any

import numpy as np
import torch

from vllm_interp.capture.consumer import CaptureMeta, PendingCapture, RowReduction
from vllm_interp.capture.dispatch import FORWARD, ConsumerRunner
from vllm_interp.capture.host_copies import (
    ReducedStep,
    ReducedSteps,
    SplitCopy,
    SteppedCopy,
    WholeCopy,
    as_array,
    give_back_dropped,
    takes_arena,
    to_host,
)
from vllm_interp.capture.results import ConsumerResult, merge_consumer_results
from vllm_interp.capture.spec import CaptureSpec, spec_from_wire
from vllm_interp.hooks import HOOK_INDEX, HOOKS, site_name
from vllm_interp.models.registry import SiteBank
from vllm_interp.models.site_ops import StepReads
from vllm_interp.request_args import interp_args
from vllm_interp.row_plan import BatchLayout, ReadAnswer, ReadPlan, count_rows, plan_reads
from vllm_interp.uploads import copy_into, to_device

logger = logging.getLogger(__name__)
MAX_UNCLAIMED_RESULTS = 4096
GOLDEN_RATIO_FRACTION = 0.6180339887498949  # successive multiples fall evenly over [0, 1) modulo 1


@dataclass
class _Entry:
    req_id: str
    key: str | None  # set when the caller fetches results
    specs: CaptureSpec  # those of the consumers this rank runs
    prompt_len: int
    sites: tuple[tuple[int, int], ...]  # (layer, hook index) this rank's consumers want, held on this rank
    # Every spec of the request, whether or not this rank runs its consumer: the positions read and whether
    # a step reads at all (and so runs eagerly) must be the same on every tensor-parallel rank, or one rank
    # replays a CUDA graph while another runs eagerly and their all-reduces no longer match.
    all_specs: CaptureSpec
    reads_held_sites: bool  # some spec wants a site this pipeline stage holds
    wants_rows: bool  # some consumer of this rank takes whole rows
    reductions: frozenset[RowReduction]  # the row summaries this rank's other consumers take instead
    # The steps this request read in, as (step, its index among the step's readers, its own parts of the step's
    # large copies); a recomputed position, after preemption, appears again (see ``CaptureStore._file``).
    chunks: list["_Chunk"] = field(default_factory=list)
    num_computed: int = 0
    last_step: int = -1  # the serial of the last step that read its rows (``CaptureStore.collect``)
    final_length: int | None = None  # the sequence length its caller gave, once it ended (``results``)
    part_bytes: int = 0  # hand its rows on in parts of about this size while it runs (0: whole, at its end)
    part_due: int = 0  # the bytes of filed rows at which its next part is cut (``part_bytes``, but its second)
    row_bytes: int = 0  # the bytes of one position's rows at its sites (set with ``part_bytes``)
    unhanded_rows: int = 0  # rows filed in ``chunks`` (a part is cut when they reach ``part_due``)
    handed: set[int] = field(default_factory=set)  # positions handed on in parts
    parts: dict[str, list[Future]] = field(default_factory=dict)  # each consumer's results of those parts
    ended_at: float = 0.0  # ``time.perf_counter()`` when it ended (``CaptureStore.results_timeline``)

    @cached_property
    def last_position(self) -> int | None:
        """The last position any of the request's specs can read (None: no end)."""
        ends = [spec.last_position(self.prompt_len) for spec in self.all_specs.values()]
        return None if None in ends else max(ends)

    @cached_property
    def reads_only_prompt(self) -> bool:
        """Whether every position its specs read is a prompt position (rows that are the request's whatever
        it generates)."""
        return self.last_position is not None and self.last_position < self.prompt_len

    @cached_property
    def reads_from(self) -> int | None:
        """The first position of a request whose specs together read every position from there on (every
        position, or every generated one, with or without the prompt's end): its steps plan that range without
        a mask. None when they read a bounded or scattered set."""
        kinds = {spec.positions if isinstance(spec.positions, str) else "listed" for spec in self.all_specs.values()}
        if "all" in kinds or {"all_generated", "all_prompt"} <= kinds:
            return 0
        if "all_generated" not in kinds or "listed" in kinds:
            return None
        return self.prompt_len - 1 if "last_prompt" in kinds else self.prompt_len

    @cached_property
    def site_set(self) -> frozenset[tuple[int, int]]:
        return _site_set(self.sites)

    def select(self, positions: np.ndarray) -> np.ndarray:
        """Which of ``positions`` some spec reads (a mask)."""
        masks = [spec.select(positions, self.prompt_len) for spec in self.all_specs.values()]
        return np.logical_or.reduce(masks)


@dataclass(frozen=True)
class _Columns:
    """Where a request's positions are in its chunks' rows laid end to end: ``positions`` ascending, each one's
    ``column`` (the latest copy of a position computed twice, after preemption), ``count`` columns in all.
    Numpy throughout: an every-token request has a column per position, and 64 of them finishing together
    took the forward thread about 16 ms with a dictionary per request (dev CPU, 512 positions).

    Chunks that lay out consecutive positions once each (those of a request never preempted, as most are) keep
    ``column`` None: a position's column is its offset from the first, found by arithmetic rather than by
    sorting and searching (a 272-position request in 17 chunks, dev CPU: laying out and looking up its columns
    45 -> 23 us of the 130 or so its finishing takes)."""

    positions: np.ndarray
    column: np.ndarray | None  # None: ``positions`` are consecutive, each at column ``position - positions[0]``
    count: int

    @classmethod
    def of(cls, chunks: list["_Chunk"]) -> "_Columns":
        if not chunks:
            return cls(np.empty(0, np.int64), np.empty(0, np.int64), 0)
        laid = np.concatenate([step.plan.positions_of(k) for step, k, _ in chunks])
        if len(laid) and laid[-1] - laid[0] == len(laid) - 1 and bool((laid[1:] > laid[:-1]).all()):
            return cls(laid, None, len(laid))  # ascending with no gap: consecutive, each once
        # np.unique's index is each value's first occurrence: in the reversed array, its latest copy.
        positions, from_end = np.unique(laid[::-1], return_index=True)
        return cls(positions, len(laid) - 1 - from_end, len(laid))

    def held(self, wanted: np.ndarray) -> np.ndarray:
        """Which of ``wanted`` (ascending) the chunks hold (a mask)."""
        if not self.count:
            return np.zeros(len(wanted), dtype=bool)
        if self.column is None:
            first = int(self.positions[0])
            return (wanted >= first) & (wanted < first + self.count)
        at = np.minimum(np.searchsorted(self.positions, wanted), len(self.positions) - 1)
        return self.positions[at] == wanted

    def columns_of(self, wanted: np.ndarray) -> np.ndarray:
        """The columns of ``wanted`` positions, every one of which the chunks hold."""
        if self.column is None:
            return wanted - self.positions[0]
        return self.column[np.searchsorted(self.positions, wanted)]

    def every_column(self, picked: np.ndarray) -> bool:
        """Whether ``picked`` (the columns of ascending positions) is every column, in order."""
        if len(picked) != self.count:
            return False
        # Consecutive positions' columns rise with them: as many as there are columns is all of them, in order.
        return self.column is None or bool((picked == np.arange(self.count)).all())


def _among(positions: np.ndarray, handed: set[int]) -> np.ndarray:
    """Which of ``positions`` were handed on in parts already (a mask)."""
    if not handed:
        return np.zeros(len(positions), dtype=bool)
    return np.isin(positions, np.fromiter(handed, dtype=np.int64, count=len(handed)))


# A request's sites, per distinct request spec (most requests of a workload want the same sites): its admission,
# every step's union of the readers' sites and its finalizing look them up instead of building them.
@lru_cache(maxsize=1024)
def _held_sites(site_lists: tuple[tuple[tuple[int, str], ...], ...],
                held: frozenset[int]) -> tuple[tuple[int, int], ...]:
    """The ``(layer, hook index)`` sites of these specs' site lists on the layers this rank holds, in order."""
    wanted = {site for sites in site_lists for site in sites}
    return tuple(sorted((layer, HOOK_INDEX[hook]) for layer, hook in wanted if layer in held))


@lru_cache(maxsize=1024)
def _interned(sites: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    """One tuple object for every step that reads these sites (``_gather`` tells them apart by identity)."""
    return sites


@lru_cache(maxsize=1024)
def _ordered(sites: frozenset[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """A set of sites in order, as ``_interned``'s one tuple (a frozenset keeps its hash: a cheap lookup)."""
    return _interned(tuple(sorted(sites)))


@lru_cache(maxsize=1024)
def _site_set(sites: tuple[tuple[int, int], ...]) -> frozenset[tuple[int, int]]:
    return frozenset(sites)


@lru_cache(maxsize=1024)
def _site_names(sites: tuple[tuple[int, int], ...], naming: str) -> tuple[str, ...]:
    return tuple(site_name(layer, HOOKS[hook], naming) for layer, hook in sites)


def _gather(chunks: list["_Chunk"], sites: list[tuple[int, int]], columns: np.ndarray | None,
            block: torch.Tensor, reduction: RowReduction | None) -> None:
    """Write ``sites`` x the chunks' ``columns`` (all, in order, when None) of their rows (or of their
    ``reduction``) into ``block``: on a consumer's runner thread, off the forward path. An every-token request
    has a chunk per step it ran in, or per steady batch whose steps were filed under the batch. Summaries are
    small: numpy views and one copy that keeps the interpreter lock (a tensor op per chunk cost 2.3 ms a request
    on the H100 host, this 1.25). Whole rows are large:
    copied by torch in one call, as numpy gives up the lock for every chunk's copy and, behind a busy forward
    loop, waits to take it back each time (512 chunks of 16 x 2048 bf16 on the dev CPU: 2.0-2.4 ms alone,
    36-44 ms beside a busy thread; torch 2.0-2.3 and 2.2-4.4; ``benchmarks/host_costs.py``)."""
    if not block.numel():
        return  # no positions (or no sites) captured
    # Each distinct site tuple's pick, by identity: steps reading the same sites share one tuple (``_interned``),
    # and hashing a tuple of sites anew for each of 512 chunks cost more than the rest of the loop.
    picks: dict[int, np.ndarray | None] = {}
    parts = []
    for step, k, own in chunks:
        key = id(step.sites)
        if key not in picks:
            where = {site: i for i, site in enumerate(step.sites)}
            index = [where[site] for site in sites]
            picks[key] = None if index == list(range(len(step.sites))) else np.array(index)
        copy = own[reduction] if own is not None and reduction in own else step.copy(reduction)
        parts.append((copy, k, picks[key]))
    if reduction is not None:
        arrays = [_part_array(copy, k) if pick is None else _part_array(copy, k)[pick] for copy, k, pick in parts]
        out = as_array(block)
        if columns is None:
            np.concatenate(arrays, axis=1, out=out)
        else:
            np.take(np.concatenate(arrays, axis=1), columns, axis=1, out=out)
        return
    tensors = [_part_tensor(copy, k) for copy, k, _ in parts]
    pick = parts[0][2]
    if len(picks) > 1:  # steps read different sets of sites (rare): each chunk picks its own
        tensors = [t if p is None else t[torch.from_numpy(p)] for t, (_, _, p) in zip(tensors, parts, strict=True)]
        pick = None
    if pick is None and columns is None:
        torch.cat(tensors, dim=1, out=block)
        return
    rows = torch.cat(tensors, dim=1)
    if pick is not None:
        rows = rows.index_select(0, torch.from_numpy(pick))
    if columns is None:
        block.copy_(rows)
    else:
        torch.index_select(rows, 1, torch.from_numpy(columns), out=block)


_Copy = SplitCopy | WholeCopy | SteppedCopy  # a step's rows (or summaries) in host memory, or a batch's steps'


def _part_tensor(source: torch.Tensor | _Copy, k: int) -> torch.Tensor:
    """A chunk's rows: its request's own tensor, or its part of the step's copy."""
    return source if isinstance(source, torch.Tensor) else source.part(k)


def _part_array(source: torch.Tensor | _Copy, k: int) -> np.ndarray:
    return as_array(source) if isinstance(source, torch.Tensor) else source.array_part(k)


@dataclass
class _StepRows:
    """A step's rows (and row summaries) on their way to host memory, then held for the requests that read
    in it until each finishes."""

    rows: _Copy | None  # [union sites, rows, hidden]; None when no request takes whole rows
    reduced: dict[RowReduction, _Copy]  # [union sites, rows, width]
    sites: tuple[tuple[int, int], ...]  # in the rows' order
    plan: ReadPlan
    in_batch: bool = False  # filed with its steady batch's other steps when that batch ends (``_SteadyReads``)
    # Readers (indices) given their own copies of their rows when it lands, out of a block held for the others.
    copied_out: frozenset[int] = frozenset()

    def copy(self, reduction: RowReduction | None) -> _Copy:
        """The copy of the rows (None) or of a reduction."""
        return self.rows if reduction is None else self.reduced[reduction]

    def copies(self) -> dict[RowReduction | None, _Copy]:
        return {**({None: self.rows} if self.rows is not None else {}), **self.reduced}

    def done(self) -> bool:
        return (self.rows is None or self.rows.done()) and all(copy.done() for copy in self.reduced.values())

    def wait(self) -> None:
        if self.rows is not None:
            self.rows.wait()
        for copy in self.reduced.values():
            copy.wait()

    @classmethod
    def interleaved(cls, steps: list["_StepRows"]) -> "_StepRows":
        """Steps of one steady batch (the same sites read, a row per request of each step), whose copies land
        whole (some may be in flight still: ``SteppedCopy`` stacks them when first read), as one step in which
        each request's rows are its rows of all of them: a request is then gathered from one part, not one per
        step (an every-token request of 512 steps: 0.3 ms of slicing on a consumer's thread, dev CPU), and its
        positions are laid out from one array when it is finalized."""
        first, count = steps[0], len(steps)
        readers = len(first.plan.req_ids)
        assert all(step.sites == first.sites and step.plan.num_rows == readers for step in steps)
        positions = np.stack([step.plan.positions for step in steps], axis=1).reshape(-1)
        plan = ReadPlan(rows=np.empty(0, np.int64), positions=positions, req_ids=first.plan.req_ids,
                        slot_starts=np.arange(0, readers * count + 1, count))
        rows = SteppedCopy([step.rows for step in steps]) if first.rows is not None else None
        reduced = {key: SteppedCopy([step.reduced[key] for step in steps]) for key in first.reduced}
        return cls(rows, reduced, first.sites, plan)

    def hand_out(self) -> dict[RowReduction | None, SplitCopy]:
        """Let go of the large copies, whose parts are each request's own (``SplitCopy``), and return them."""
        large = {key: copy for key, copy in self.copies().items() if isinstance(copy, SplitCopy)}
        if None in large:
            self.rows = None
        self.reduced = {key: copy for key, copy in self.reduced.items() if key not in large}
        return large


@dataclass
class _SteadyReads:
    """A decode step's plan in which every request of the batch read its one new row and reads every row from
    there on, without end (every-token capture): the next step with the same batch, one token each, reads the
    same rows of the same requests, so it is planned without deciding again what each request reads (a decode
    step of 64 requests: 40 us of the forward thread on the dev CPU planned request by request, 12 this way;
    ``benchmarks/host_costs.py``).

    While it lasts, its steps are kept for the batch as a whole rather than for each request: the requests'
    computed counts (the last step's ends), the serial of the last step collected, which sites the step reads
    and what its consumers take, and its steps (``steps``, when no request takes parts and a step's copies land
    whole). ``settle`` writes these into each request once it is dropped, its steps as one, landed or not
    (``_StepRows.interleaved``), so that a steady step's bookkeeping on the forward thread does not grow with
    the batch (loops over 64 requests took about 0.3 ms of an H200 host's decode step under torch's Python
    tracer, which inflates such loops) and a request's rows are one chunk. Dropped
    (``CaptureStore._drop_steady``) when a step differs or a request ends: an ended request may still be in
    the batch, reading nothing more."""

    req_ids: list[str]
    entries: list[_Entry]
    rows: np.ndarray
    slot_starts: np.ndarray
    splits: list[tuple[int, int]]
    sites: frozenset[tuple[int, int]]  # the union of its requests' sites
    wants_rows: bool  # some consumer takes whole rows
    reductions: frozenset[RowReduction]
    files_whole: bool  # no request takes parts: its steps are filed under the batch (``steps``)
    in_parts: bool  # every request takes parts: a step's copies are let go of within about a part
    stops: np.ndarray | None = None  # each request's computed count after the last step planned
    last_collected: int = -1  # the serial of its last step collected
    # Those collected under it whose copies land whole (``files_whole``): filed with it when it settles.
    steps: list["_StepRows"] = field(default_factory=list)
    # Each reduction's steps reduced into blocks of several steps (``ReducedSteps``), when no consumer takes whole
    # rows or parts: a step's summaries land with their block (sent when full, and when the batch settles).
    reduced_steps: dict[RowReduction, ReducedSteps] = field(default_factory=dict)

    def reduce(self, reduction: RowReduction, block: torch.Tensor) -> ReducedStep:
        """Reduce a step's ``[sites, rows, hidden]`` block into the batch's blocks of steps."""
        steps = self.reduced_steps.get(reduction)
        shape = (*block.shape[:-1], reduction.width)
        if steps is None or steps.shape != shape:  # never within one batch, which reads the same sites and rows
            if steps is not None:
                steps.send()
            steps = self.reduced_steps[reduction] = ReducedSteps(reduction, shape, block.device)
        return steps.add(block, self.splits)

    def plan(self, req_ids: list[str], total_tokens: int, position_starts: np.ndarray) -> ReadPlan | None:
        """The plan of a step of ``req_ids`` (``total_tokens`` in all, each request's from ``position_starts``),
        when it is the same batch one token further (else None)."""
        if total_tokens != len(self.req_ids) or req_ids != self.req_ids:
            return None
        # A copy: the positions may be a view of the runner's buffers, which the next step rewrites.
        positions = np.array(position_starts[:total_tokens], dtype=np.int64)
        self.stops = positions + 1 if self.stops is None else np.maximum(self.stops, positions + 1)
        return ReadPlan(rows=self.rows, positions=positions, req_ids=self.req_ids, slot_starts=self.slot_starts)

    def settle(self) -> None:
        """Write what its steps did into each request (once it is no longer used): computed counts, the last
        step each read in, and its steps, after the chunks each request had."""
        for steps in self.reduced_steps.values():  # the steps reduced since the last full block
            steps.send()
        stops = self.stops.tolist() if self.stops is not None else [0] * len(self.entries)
        merged = _StepRows.interleaved(self.steps) if self.steps else None
        for k, (entry, stop) in enumerate(zip(self.entries, stops, strict=True)):
            entry.num_computed = max(entry.num_computed, stop)
            entry.last_step = max(entry.last_step, self.last_collected)
            if merged is not None and entry.sites:
                entry.chunks.append((merged, k, None))
        self.steps = []

    @classmethod
    def of(cls, layout: BatchLayout, answers: dict[int, ReadAnswer], entries: list[_Entry],
           plan: ReadPlan) -> "_SteadyReads | None":
        """The steady form of ``plan`` (planned for ``answers`` about ``layout``), if it is one."""
        count = len(layout.req_ids)
        if len(answers) != count or layout.total_tokens != count:  # a request that does not read, or a prefill
            return None
        if any(entry.last_position is not None for entry in entries):
            return None
        starts = layout.position_starts.tolist()
        if not all(isinstance(answer, int) and answer <= starts[i] for i, answer in answers.items()):
            return None
        return cls(plan.req_ids, entries, plan.rows, plan.slot_starts, plan.splits(),
                   sites=_readers_sites(entries), wants_rows=any(entry.wants_rows for entry in entries),
                   reductions=_readers_reductions(entries),
                   files_whole=not any(entry.part_bytes for entry in entries),
                   in_parts=all(entry.part_bytes for entry in entries))


def _readers_sites(entries: Iterable[_Entry]) -> frozenset[tuple[int, int]]:
    # Requests of a step mostly want the same sites: the union of the distinct sets, not of every request's.
    return frozenset().union(*{entry.site_set for entry in entries})


def _readers_reductions(entries: Iterable[_Entry]) -> frozenset[RowReduction]:
    return frozenset().union(*{entry.reductions for entry in entries})  # of the distinct sets: one, mostly


# (step, the request's index among the step's readers, its own parts of the step's large copies or None)
_Chunk = tuple[_StepRows, int, dict[RowReduction | None, torch.Tensor] | None]


class CaptureStore:
    def __init__(self, bank: SiteBank, *, num_layers: int, model: str, consumers: dict[str, ConsumerRunner],
                 global_spec: CaptureSpec, external_id: Callable[[str], str], max_graph_tokens: int) -> None:
        """``external_id``: the caller's request id for the engine's (which may carry a suffix of vLLM's);
        ``max_graph_tokens``: the most tokens a step that replays a CUDA graph has (0: graphs are off)."""
        self.bank = bank
        self.max_graph_tokens = max_graph_tokens
        self.external_id = external_id
        self.num_layers = num_layers
        self.model = model
        self.consumers = consumers
        self.global_spec = global_spec
        self._held = frozenset(bank.layers)
        self._entries: dict[str, _Entry | None] = {}
        self._live: set[str] = set()  # requests whose capture is not finalized yet
        # Live requests that may still read: one whose computed positions passed its specs' last position
        # (a capture of prompt positions, once the prompt is done) leaves, so steps no longer plan for it.
        self._reading: set[str] = set()
        self._by_key: dict[str, str] = {}
        self._results: dict[str, dict[str, Future]] = {}
        self._pending: list[_StepRows] = []
        self._collected = 0  # steps collected so far; the next one's serial
        self._filed = 0  # steps landed so far, filed or left to their steady batch: every smaller serial has landed
        self._ending: dict[str, _Entry] = {}  # ended, waiting for the copies of their steps to land
        self._part_phases = (k * GOLDEN_RATIO_FRACTION for k in itertools.count())  # see ``_hand_part``
        self._armed_rows: torch.Tensor | None = None  # graph read buffer entries the last step set
        self._last_rows: tuple[np.ndarray, torch.Tensor] | None = None  # the last planned rows, and on the device
        self._steady: _SteadyReads | None = None  # the last step's plan, when the next one may repeat it
        self._armed_sites: frozenset[tuple[int, int]] = frozenset()  # the sites the graph read flags name
        self._read_slots = torch.arange(bank.graph_read_rows, device=bank.read_slot.device)  # each read row's slot
        self._site_readers: dict[tuple[tuple[int, int], ...], Callable[[int], torch.Tensor]] = {}  # by ``_graph_block``
        self._last_block: tuple[tuple[tuple[int, int], ...], int, torch.Tensor] | None = None  # its last view
        # Steps that read rows, by how the sites read them: inside a replayed CUDA graph, or eagerly; and how
        # many of them were collected as a steady batch's (``_SteadyReads``).
        self.read_steps = {"graph": 0, "eager": 0, "steady": 0}
        # The callers' asks for results (``results``; each API server polls on its own) and the seconds this
        # thread spent answering them: the forward thread's, between steps.
        self.results_asks = {"asks": 0, "seconds": 0.0}
        # Where the wait for a claimed request's results goes, summed over the requests answered: from its end
        # to its rows landed and handed to the consumers, to the consumers done, to the answer that took them.
        self.results_timeline = {"answered": 0, "land_s": 0.0, "consume_s": 0.0, "claim_s": 0.0}
        # Requests the scheduler reported finished with their final length, and the positions their captures
        # dropped as past it (an async scheduler's step that ran past a stop; ``_finalize``).
        self.ends = {"finished_with_length": 0, "positions_past_end": 0}
        self._result_times: dict[str, tuple[float, float, list[float]]] = {}  # key -> ended, handed, [done]
        self._warm_reductions()

    def _warm_reductions(self) -> None:
        """Run each consumer's row reduction once on a row of the model's width and dtype. Its first call may
        build a kernel (``logging``'s statistics: Triton compiles one, about 0.4 s of an H200 host's forward
        thread, during which no step runs): at start-up, not in the first step that captures."""
        hidden, dtype, device = self.bank.residual
        row = torch.zeros(1, hidden, dtype=dtype, device=device)
        for reduction in {runner.row_reduction for runner in self.consumers.values()} - {None}:
            reduction.reduce(row)

    # -- planning ---------------------------------------------------------------------------------------
    def lookup(self, req_id: str, extra_args: dict[str, Any] | None, prompt_len: int) -> _Entry | None:
        # A request ended before it finished (``_end_while_running``) stays here as None until the scheduler
        # reports it finished.
        if req_id in self._entries:
            return self._entries[req_id]
        args = interp_args(extra_args)
        all_specs = {**self.global_spec, **spec_from_wire(args.get("capture") or {})}
        # Tensor-parallel ranks other than 0 run only the consumers that every rank needs (patch sources).
        specs = {name: spec for name, spec in all_specs.items() if name in self.consumers}
        entry = None
        if all_specs:
            reductions = {self.consumers[name].row_reduction for name in specs}
            entry = _Entry(req_id, args.get("capture_key"), specs, prompt_len, self._held_sites(specs), all_specs,
                           bool(self._held_sites(all_specs)), wants_rows=None in reductions,
                           reductions=frozenset(reductions - {None}))
            # In parts only when every consumer of the request takes parts: each part lets go of its rows.
            part_sizes = [self.consumers[name].part_bytes(spec.options) for name, spec in specs.items()]
            entry.part_bytes = entry.part_due = min(part_sizes) if part_sizes and all(part_sizes) else 0
            hidden, dtype, _ = self.bank.residual
            entry.row_bytes = len(entry.sites) * hidden * dtype.itemsize
            if entry.key is not None:
                self._by_key[entry.key] = req_id
        self._entries[req_id] = entry
        if entry is not None:
            self._live.add(req_id)
            self._reading.add(req_id)
        return entry

    def _held_sites(self, specs: CaptureSpec) -> tuple[tuple[int, int], ...]:
        return _held_sites(tuple(spec.sites(self.num_layers) for spec in specs.values()), self._held)

    def _spec_sites(self, spec: Any) -> tuple[tuple[int, int], ...]:
        """One consumer spec's sites on the layers this rank holds (none: another pipeline stage holds them)."""
        return _held_sites((spec.sites(self.num_layers),), self._held)

    @property
    def capturing(self) -> bool:
        """Whether any request on this worker still captures (if not, steps need no read planning)."""
        return bool(self._live)

    @property
    def quiet(self) -> bool:
        """No request may read and the graph read buffers name no rows or sites: a step needs no read plan."""
        return not self._reading and self._armed_rows is None and not self._armed_sites

    @property
    def reading_ids(self) -> set[str]:
        """The live requests that may still read: the only ones a step plans reads for."""
        return self._reading

    def plan_reads(self, layout: BatchLayout) -> ReadPlan:
        """The rows this step reads: those of the requests that may still read, at the positions they want.
        Notes each reading request's progress; one whose specs can read no further leaves the reading set."""
        answers: dict[int, ReadAnswer] = {}
        done = []
        reading, entries = self._reading, self._entries
        if not reading:  # no request reads: an enabled but idle engine plans this before every step
            return plan_reads(layout, answers)
        if self._steady is not None:
            if (plan := self._steady.plan(layout.req_ids, layout.total_tokens, layout.position_starts)) is not None:
                return plan
            self._drop_steady()
        starts, counts = layout.position_starts.tolist(), layout.num_tokens.tolist()
        readers = []
        for i, req_id in enumerate(layout.req_ids):
            if req_id not in reading:
                continue
            entry, start = entries[req_id], starts[i]
            stop = start + counts[i]
            entry.num_computed = max(entry.num_computed, stop)
            answers[i] = self._wanted(entry, start, counts[i])
            readers.append(entry)
            last = entry.last_position
            if last is not None and stop > last:
                # Every position it reads is computed (a recompute after preemption would read the same rows).
                done.append(req_id)
        reading.difference_update(done)
        plan = plan_reads(layout, answers)
        self._steady = _SteadyReads.of(layout, answers, readers, plan)
        return plan

    def steady_reads(self, req_ids: list[str], total_tokens: int, position_starts: np.ndarray,
                     device: torch.device) -> tuple[ReadPlan, StepReads | None] | None:
        """``plan_reads`` and ``site_reads`` of a step that is the steady batch one token further (every decode
        step of every-token capture), without the batch laid out: the same rows of the same requests at the next
        positions, at the same sites (so ``site_reads`` finds its rows uploaded and armed already). None for any
        other step, which is planned in full. On an H100 host's loaded forward thread the full plan of such a step
        took about 80 us (py-spy)."""
        steady = self._steady
        if steady is None or (plan := steady.plan(req_ids, total_tokens, position_starts)) is None:
            return None
        return plan, self.site_reads(plan, device, total_tokens)

    def _steady_of(self, plan: ReadPlan) -> _SteadyReads | None:
        """The steady batch ``plan`` is a step of, if it is one (while that batch lasts)."""
        steady = self._steady
        return steady if steady is not None and steady.req_ids is plan.req_ids else None

    def _drop_steady(self) -> None:
        if self._steady is not None:
            self._steady.settle()
            self._steady = None

    def count_reads(self, scheduled: Iterable[tuple[str, int, int]]) -> int:
        """How many rows a step scheduling these ``(req_id, position_start, num_tokens)`` would read, without
        planning it (a runner that must choose between graphs and eager execution before it lays out the batch
        asks this first). Requests that can no longer read are skipped."""
        reading, entries = self._reading, self._entries
        return sum(count_rows(self._wanted(entries[req_id], start, count), start, count)
                   for req_id, start, count in scheduled if req_id in reading)

    @staticmethod
    def _wanted(entry: _Entry, position_start: int, num_tokens: int) -> ReadAnswer:
        if not entry.reads_held_sites:
            return None  # a pipeline stage holding none of the wanted layers has nothing to read
        if entry.reads_from is not None:
            return entry.reads_from
        return entry.select(np.arange(position_start, position_start + num_tokens))

    def site_reads(self, plan: ReadPlan, device: torch.device, step_tokens: int) -> StepReads | None:
        """What the site ops read this step (of ``step_tokens`` tokens): the planned rows, at the sites some
        request of the step wants. Within the graph row budget the graph read buffers are armed too, for the case
        the step replays; a step too large for any graph (a prefill chunk) leaves them as they are: the next step
        that may replay sets them."""
        # A rank that runs none of the step's consumers plans the same rows (so it decides between graphs and
        # eager execution as the others do) but reads nothing.
        reads = None
        if plan.req_ids:
            steady = self._steady_of(plan)
            sites = steady.sites if steady is not None else _readers_sites(self._entries[r] for r in plan.req_ids)
            reads = StepReads(self._device_rows(plan.rows, device), sites) if sites else None
        if self.bank.graph_read_rows and self.may_replay(step_tokens):
            self._arm_graph_reads(reads if reads is not None and self.fits_graph(plan.num_rows) else None)
        return reads

    def _device_rows(self, rows: np.ndarray, device: torch.device) -> torch.Tensor:
        """``rows`` on the device: the last step's tensor when they are the same rows (decode steps of a steady
        batch are), so such a step uploads nothing and its graph read buffers stay armed as they are. Each
        torch call on an H200 host's loaded forward thread costs tens of microseconds, and an every-token decode
        step at serving speed lasts 3-4 ms."""
        last = self._last_rows
        if last is not None and (last[0] is rows or np.array_equal(last[0], rows)):
            return last[1]
        uploaded = to_device(rows, device)
        self._last_rows = (rows, uploaded)
        return uploaded

    def may_replay(self, step_tokens: int) -> bool:
        """Whether a step of ``step_tokens`` tokens may replay CUDA graphs at all (no larger one is captured)."""
        return step_tokens <= self.max_graph_tokens

    def fits_graph(self, num_rows: int) -> bool:
        """Whether a step reading ``num_rows`` rows may replay CUDA graphs (the same answer on every rank)."""
        return num_rows <= self.bank.graph_read_rows

    def _arm_graph_reads(self, reads: StepReads | None) -> None:
        """Point the graph read buffers at this step's rows and sites, and clear what the last step set."""
        bank = self.bank
        # Tensor methods, not indexed assignment: Python's indexing path cost about 80 us a decode step of an
        # H200 host's forward thread for these two writes (py-spy).
        rows = reads.rows if reads is not None else None
        if rows is not self._armed_rows:  # the same tensor: the same rows are armed already
            if self._armed_rows is not None:
                bank.read_slot.index_fill_(0, self._armed_rows, -1)
            if rows is not None:
                bank.read_slot.index_copy_(0, rows, self._read_slots[: len(rows)])
            self._armed_rows = rows
        sites = reads.sites if reads is not None else frozenset()
        if sites != self._armed_sites:  # steps of one workload mostly read the same sites: no upload then
            flags = np.zeros(tuple(bank.read_flags.shape), dtype=np.int32)
            for layer, hook in sites:
                flags[bank.layer_index[layer], hook] = 1
            copy_into(bank.read_flags, flags)
            self._armed_sites = sites

    # -- after the forward ------------------------------------------------------------------------------
    def collect(self, plan: ReadPlan, reads: StepReads) -> None:
        """Start copying this step's rows (and each row reduction's block) off the device, one transfer each,
        without waiting for them."""
        self._drain(needed=())  # file earlier steps' copies that have landed
        self.read_steps["eager" if reads.out else "graph"] += 1
        if reads.out:  # the step ran eagerly: the op handed its rows over
            sites = _interned(tuple(sorted(reads.out)))
            block = torch.stack([reads.out[site] for site in sites])
        else:  # a graph replay read into the buffers the rows were armed in
            sites = _ordered(reads.sites)
            block = self._graph_block(sites, len(reads.rows))
        steady = self._steady_of(plan)
        if steady is not None:  # its requests' last steps are noted when it is settled
            self.read_steps["steady"] += 1
            steady.last_collected = self._collected
            splits, whole, in_parts = steady.splits, False, steady.in_parts
            wants_rows, reductions = steady.wants_rows, steady.reductions
        else:
            splits = plan.splits()
            # A request finalized since the step was planned files nothing (``_file``).
            entries = [entry for req_id in plan.req_ids if (entry := self._entries.get(req_id)) is not None]
            for entry in entries:
                entry.last_step = self._collected
            # Requests that read their last prompt rows in this step end with it: each goes to its consumers
            # once the step lands, not when it finishes generating, so the step's block is let go of within a
            # few steps and may land whole (no copy per request on this thread).
            ending = [entry for entry in entries if entry.req_id not in self._reading and entry.reads_only_prompt]
            for entry in ending:
                self._end_while_running(entry, None)
            whole = len(ending) == len(entries)
            in_parts = bool(entries) and all(entry.part_bytes for entry in entries)
            wants_rows, reductions = any(e.wants_rows for e in entries), _readers_reductions(entries)
        copied_out: frozenset[int] = frozenset()
        if in_parts and takes_arena(block):
            # The arena's ring waits for its oldest region, so a block held there for long would send every later
            # large block to fresh pinned memory: it is held for the readers whose rows in it fill a part, which
            # then goes out as soon as the next step lands (a burst's prefill steps; never a decode step). The
            # others' rows (requests decoding in a prefill step) are copied out of it when it lands; when no
            # reader fills a part, it is split as any large block.
            copied_out = frozenset(
                k for k, req_id in enumerate(plan.req_ids) if (entry := self._entries.get(req_id))
                and len(plan.positions_of(k)) * entry.row_bytes < entry.part_due)
            in_parts = len(copied_out) < len(plan.req_ids)
            copied_out = copied_out if in_parts else frozenset()
        self._collected += 1
        # Whole rows leave the device only when some request takes them; summaries are reduced here, on it.
        rows = to_host(block, splits, whole, in_parts) if wants_rows else None
        if steady is not None and steady.files_whole and not wants_rows:
            reduced = {r: steady.reduce(r, block) for r in reductions}
        else:
            reduced = {r: to_host(r.reduce(block), splits, whole, in_parts) for r in reductions}
        step = _StepRows(rows, reduced, sites, plan, copied_out=copied_out)
        if steady is not None and steady.files_whole and all(
                isinstance(copy, WholeCopy) for copy in step.copies().values()):
            step.in_batch = True
            steady.steps.append(step)
        self._pending.append(step)

    def _graph_block(self, sites: tuple[tuple[int, int], ...], num_rows: int) -> torch.Tensor:
        """``[sites, num_rows, hidden]``: the rows a replayed step read into the graph read buffers. Sites that
        are one hook of consecutive layers, or every hook of them (every-token workloads), are a view of the
        buffers: no index tensors, no gathering kernel (the step's readers copy or reduce it on the same stream,
        before the next replay writes the buffers). Other sets are gathered, their index uploaded once."""
        last = self._last_block
        if last is not None and last[0] is sites and last[1] == num_rows:
            return last[2]  # steps of a steady batch read the same rows: the same view
        if sites not in self._site_readers:
            if len(self._site_readers) >= 64:  # requests may want any set of sites: keep the recent ones
                self._site_readers.clear()
            self._site_readers[sites] = self._site_reader(sites)
        block = self._site_readers[sites](num_rows)
        self._last_block = (sites, num_rows, block)
        return block

    def _site_reader(self, sites: tuple[tuple[int, int], ...]) -> Callable[[int], torch.Tensor]:
        out = self.bank.read_out  # [held layers, hooks, rows, hidden]
        layers = [self.bank.layer_index[layer] for layer, _ in sites]  # in the buffers' numbering
        hooks = [hook for _, hook in sites]
        first, count, num_hooks = layers[0], len(sites), out.shape[1]
        if hooks == [hooks[0]] * count and layers == list(range(first, first + count)):
            return lambda rows: out[first : first + count, hooks[0], :rows]
        span = count // num_hooks
        if (count % num_hooks == 0 and hooks == list(range(num_hooks)) * span
                and layers == [first + i // num_hooks for i in range(count)]):
            return lambda rows: out[first : first + span, :, :rows].flatten(0, 1)
        layer_index, hook_index = to_device(np.array(layers), out.device), to_device(np.array(hooks), out.device)
        return lambda rows: out[layer_index, hook_index, :rows]

    def _drain(self, needed: Container[str] | None = None) -> None:
        """File the rows of copies that have landed under their requests. Copies holding rows of ``needed``
        requests (every request when None) are waited for; later ones are filed only if already done, so that
        a step never waits for the device on behalf of requests that are still running."""
        give_back_dropped()  # held memory whose views are gone, also when no copy follows (the results' polls)
        last_needed = -1 if needed is not None and not needed else max(
            (i for i, step in enumerate(self._pending)
             if needed is None or any(req_id in needed for req_id in step.plan.req_ids)), default=-1)
        filed = 0
        for i, step in enumerate(self._pending):
            if i > last_needed and not step.done():
                break  # steps land in order: the rest are in flight too
            step.wait()
            self._file(step)
            filed += 1
        del self._pending[:filed]
        self._filed += filed
        landed = [req_id for req_id, entry in self._ending.items() if entry.last_step < self._filed]
        if not landed:
            return
        # The runners start on them once all are handed on: a runner woken by each hand-off took the interpreter
        # lock from this thread every time (64 every-token requests ending together, dev CPU: 29-31 ms of this
        # thread, 9 with the runners held back).
        with FORWARD.launching():
            for req_id in landed:
                entry = self._ending.pop(req_id)
                self._finalize(entry, entry.final_length)

    def _file(self, step: _StepRows) -> None:
        """File a landed step under each request that read in it. Large copies landed split per request: each
        request takes its own parts and the step lets go of them, so a long request never keeps the others'
        rows alive. Copies landed whole (small ones, ones copied out whole, ones read where they landed) stay
        with the step, read as views when a request's rows are gathered: filing such a step costs one tuple per
        request (a steady batch's step, ``in_batch``, is filed with the rest of its batch when the batch
        settles, and nothing here). Readers given their own copies of a held block (``copied_out``)
        file the step without it."""
        if step.in_batch:
            return  # filed under each of its requests with the rest of its batch's steps (``_SteadyReads.settle``)
        entries, ending, large = self._entries, self._ending, step.hand_out()
        # Readers whose rows are copied out of a held block file a step without its copies, which would keep the
        # block alive for as long as they run.
        bare = _StepRows(None, {}, step.sites, step.plan) if step.copied_out else None
        own_copies = {key: copy.copies_of(sorted(step.copied_out))
                      for key, copy in step.copies().items()} if step.copied_out else {}
        # Each reader's rows in the step, counted in one call: this loop runs for every request of every step.
        counts = np.diff(step.plan.slot_starts).tolist()
        for k, req_id in enumerate(step.plan.req_ids):
            entry = entries.get(req_id) or ending.get(req_id)
            if entry is not None and entry.sites:
                if k in step.copied_out:
                    entry.chunks.append((bare, k, {key: copies[k] for key, copies in own_copies.items()}))
                else:
                    entry.chunks.append(
                        (step, k, {key: copy.part(k) for key, copy in large.items()} if large else None))
                if entry.part_bytes and req_id not in ending:
                    entry.unhanded_rows += counts[k]
                    if entry.unhanded_rows * entry.row_bytes >= entry.part_due and len(entry.chunks) > 1:
                        self._hand_part(entry)

    def _hand_part(self, entry: _Entry) -> None:
        """Hand a running request's landed rows, but its newest step's, to its consumers as its next part.

        Requests that decode together reach the part size at the same step, so their parts would come in a
        burst: on an H200 host 64 every-token requests each handed 8 MiB at once, past their consumer's
        queue, and the engine waited for the consumer, which then idled until the next burst (py-spy:
        waiting for room was 17% of the forward thread's samples, the consumer's process idle 70% of the
        phase). A request's second part is therefore cut later by a fraction of a part, a fraction taken in
        turn from a golden-ratio sequence, so that the parts of a batch come spread over the steps."""
        first = not entry.handed
        entry.part_due = entry.part_bytes + (int(next(self._part_phases) % 1.0 * entry.part_bytes) if first else 0)
        chunks, entry.chunks = entry.chunks[:-1], entry.chunks[-1:]
        step, k, _ = entry.chunks[0]
        entry.unhanded_rows = len(step.plan.positions_of(k))
        columns = _Columns.of(chunks)
        positions = columns.positions[~_among(columns.positions, entry.handed)]
        for name, spec in entry.specs.items():
            sites = self._spec_sites(spec)
            picked = positions[spec.select(positions, entry.prompt_len)] if sites else positions[:0]
            if len(picked):
                parts = entry.parts.setdefault(name, [])
                parts.append(self._hand_on(name, spec, entry, chunks, columns, sites, picked,
                                           ConsumerResult(status="ok", rows=len(picked) * len(sites)),
                                           part=len(parts), final=False))
        entry.handed.update(positions.tolist())

    # -- finishing --------------------------------------------------------------------------------------
    def finish(self, finished_req_ids: set[str], final_lengths: Mapping[str, int] | None = None) -> None:
        """The scheduler reported these requests finished (normally or aborted), with their final lengths where
        it knows them: each is finalized once its steps' copies have landed (now, or as later steps are
        collected or its results asked for), without rows past its length (see ``_finalize``)."""
        if not finished_req_ids:
            return
        lengths = final_lengths or {}
        for req_id in finished_req_ids:
            entry = self._entries.pop(req_id, None)
            if entry is not None:
                length = lengths.get(req_id)
                self.ends["finished_with_length"] += length is not None
                self._end(entry, length)
        self._drain(needed=())

    def _end_while_running(self, entry: _Entry, length: int | None) -> None:
        """End a request the scheduler still runs: it stays known as None, so that it captures nothing more
        (a preempted request comes back through ``lookup``) until the scheduler reports it finished."""
        self._entries[entry.req_id] = None
        self._end(entry, length)

    def _end(self, entry: _Entry, length: int | None) -> None:
        self._live.discard(entry.req_id)
        self._reading.discard(entry.req_id)
        self._drop_steady()
        entry.final_length = length
        entry.ended_at = time.perf_counter()
        self._ending[entry.req_id] = entry

    def results(self, lengths: dict[str, int | None], wait_s: float) -> dict[str, dict[str, dict[str, Any]]]:
        """Results of the requests with these capture keys (``lengths``: key -> final sequence length; None for
        a request that may still run, asked for early: it is not ended here).

        Ends requests not ended yet, finalizes those whose rows have landed (waiting for the copies only when
        ``wait_s`` allows), waits up to ``wait_s`` for their consumers, and returns (and forgets) the results
        of those whose consumers all finished; the caller asks again for the rest.
        """
        started = time.perf_counter()
        try:
            return self._answer(lengths, wait_s)
        finally:
            self.results_asks["asks"] += 1
            self.results_asks["seconds"] += time.perf_counter() - started

    def _answer(self, lengths: dict[str, int | None], wait_s: float) -> dict[str, dict[str, dict[str, Any]]]:
        for key, length in lengths.items():
            req_id = self._by_key.get(key)
            entry = self._entries.get(req_id) if req_id is not None else None
            if entry is not None and length is not None:
                self._end_while_running(entry, length)
        # A caller that may wait (offline) waits for the copies too; the API server's polls (no wait) run
        # between the engine's steps and take only what has landed.
        self._drain(needed={self._by_key.get(key) for key in lengths} if wait_s > 0 else ())
        asked = [f for key in lengths for f in self._results.get(key, {}).values()]
        if wait_s > 0:
            wait(asked, timeout=wait_s)
        done = {}
        for key in lengths:
            futures = self._results.get(key)
            if futures is None:
                req_id = self._by_key.get(key)
                if req_id not in self._ending and self._entries.get(req_id) is None:
                    # Never seen here: the request never ran a step on this worker, or this rank captures nothing
                    # (one asked for early and still capturing is neither).
                    done[key] = {}
                continue
            if all(f.done() for f in futures.values()):
                del self._results[key]
                self._by_key.pop(key, None)
                done[key] = {name: f.result().as_dict() for name, f in futures.items()}
                self._time_answer(key)
        return done

    def _time_answer(self, key: str) -> None:
        # Set beside ``_results[key]`` (``_time_consumers``) and dropped with it (``_forget_unclaimed``).
        ended, handed, (consumed,) = self._result_times.pop(key)
        timeline = self.results_timeline
        timeline["answered"] += 1
        timeline["land_s"] += handed - ended
        timeline["consume_s"] += consumed - handed
        timeline["claim_s"] += time.perf_counter() - consumed

    def _finalize(self, entry: _Entry, length: int | None) -> None:
        # The last sampled token is never fed back: with the final length known, rows past it (an async
        # scheduler's step that ran past a stop) are not part of the request.
        computed = entry.num_computed if length is None else min(entry.num_computed, max(length - 1, 0))
        self.ends["positions_past_end"] += entry.num_computed - computed
        columns = _Columns.of(entry.chunks)
        futures = {}
        for name, spec in entry.specs.items():
            sites = self._spec_sites(spec)
            if not sites:
                continue  # another pipeline stage holds this consumer's layers
            final = self._submit(name, spec, entry, columns, sites, computed)
            parts = entry.parts.get(name)
            futures[name] = _merged([*parts, final], self.consumers[name].consumer_class.merge_parts) if parts \
                else final
        if entry.key is not None:
            self._results[entry.key] = futures
            self._time_consumers(entry, futures)
            self._forget_unclaimed()
        else:
            for name, future in futures.items():
                future.add_done_callback(lambda f, n=name, r=entry.req_id: _log_failure(n, r, f.result()))

    def _time_consumers(self, entry: _Entry, futures: dict[str, Future]) -> None:
        """Note when ``entry``'s results were handed on and when its last consumer is done with them."""
        handed = time.perf_counter()
        consumed = [handed]

        def done(_: Future) -> None:  # in the consumer's thread
            consumed[0] = max(consumed[0], time.perf_counter())

        self._result_times[entry.key] = (entry.ended_at, handed, consumed)
        for future in futures.values():
            future.add_done_callback(done)

    def _forget_unclaimed(self) -> None:
        """Results whose caller went away (an HTTP client that disconnected) are never asked for: keep only
        the newest ``MAX_UNCLAIMED_RESULTS``."""
        while len(self._results) > MAX_UNCLAIMED_RESULTS:
            key = next(iter(self._results))
            futures = self._results.pop(key)
            self._by_key.pop(key, None)
            self._result_times.pop(key, None)
            for name, future in futures.items():
                future.add_done_callback(lambda f, n=name, k=key: _log_failure(n, k, f.result()))
            logger.warning("capture results for key %s were never claimed; dropped them", key)

    def _submit(self, name: str, spec: Any, entry: _Entry, columns: _Columns, sites: tuple[tuple[int, int], ...],
                computed: int) -> Future:
        expected = spec.expected_positions(entry.prompt_len, computed)
        if isinstance(spec.positions, list):
            beyond = sorted(set(spec.positions) - set(expected.tolist()))
            if beyond:
                return _resolved(ConsumerResult.failed(
                    f"positions {beyond} were never computed: the sequence went through the model for {computed} "
                    "tokens (the last generated token is never fed back)"
                ))
        held, handed = columns.held(expected), _among(expected, entry.handed)
        missing = expected[~(held | handed)]
        message = None
        dropped = len(missing) * len(sites)
        if dropped:
            message = (f"positions {missing[:8].tolist()}{'...' if len(missing) > 8 else ''} were not computed by "
                       "this engine")
        own = expected[held & ~handed]  # not handed on in a part already
        status = "partial_error" if message else "ok"
        base = ConsumerResult(status=status, message=message, rows=len(own) * len(sites), dropped=dropped)
        return self._hand_on(name, spec, entry, entry.chunks if len(own) else [], columns, sites, own, base,
                             part=len(entry.parts.get(name, [])), final=True)

    def _hand_on(self, name: str, spec: Any, entry: _Entry, chunks: list[_Chunk], columns: _Columns,
                 sites: tuple[tuple[int, int], ...], positions: np.ndarray, base: ConsumerResult,
                 *, part: int, final: bool) -> Future:
        """Submit ``positions`` (ascending) of the request's rows in ``chunks`` (at their ``columns``) to a
        consumer."""
        picked = columns.columns_of(positions)
        every_column = columns.every_column(picked)
        reduction = self.consumers[name].row_reduction
        width, dtype = (reduction.width, torch.float32) if reduction else self.bank.residual[:2]
        meta = CaptureMeta(
            request_id=self.external_id(entry.req_id), tag=spec.tag, model=self.model,
            prompt_len=entry.prompt_len, positions=positions.tolist(),
            sites=list(_site_names(sites, spec.naming)),
            dtype=str(dtype).removeprefix("torch."), options=spec.options, part=part, final=final,
        )
        wanted = None if every_column else picked
        rows = PendingCapture(meta, width, dtype, lambda block: _gather(chunks, sites, wanted, block, reduction))
        return self.consumers[name].submit(rows, base)

    def close(self) -> None:
        self._drain()  # every ended request reaches its consumers before they close
        for runner in self.consumers.values():
            runner.close()


def _merged(parts: list[Future], merge_payloads: Callable[[list[dict[str, Any]]], dict[str, Any]]) -> Future:
    """One future of a request's result from those of its parts, resolved when the last of them is."""
    merged: Future = Future()
    left = [len(parts)]
    lock = threading.Lock()

    def one_done(_: Future) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        merged.set_result(merge_consumer_results([part.result() for part in parts], merge_payloads))

    for part in parts:
        part.add_done_callback(one_done)
    return merged


def _resolved(result: ConsumerResult) -> Future:
    future: Future = Future()
    future.set_result(result)
    return future


def _log_failure(consumer: str, req_id: str, result: ConsumerResult) -> None:
    if result.status != "ok":
        logger.warning("capture of request %s by %s: %s (%s)", req_id, consumer, result.status, result.message)
