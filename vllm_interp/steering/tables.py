"""Worker side of steering: per-layer tables of summed vectors, and the table row of every token.

Each layer holds ``table[hook, row]``. Row 0 is zeros (unsteered tokens), rows 1 and 2 the global prefill
and decode vectors (global base + tier), and each per-request config slot ``s`` owns rows ``3 + 2s``
(prefill) and ``4 + 2s`` (decode), which already include the global vectors. Identical request specs share
a slot; a slot is freed when its last request leaves the batch. Rows are queued as configs arrive and written
together before the step's index that points at them (global vectors: at once). Tables change only by
in-place writes, so compiled graphs see them.
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import chain
from typing import Any, Literal

import numpy as np

from vllm_interp.hooks import HOOK_INDEX, parse_site_name
from vllm_interp.models.registry import SiteBank
from vllm_interp.request_args import interp_args
from vllm_interp.row_plan import BatchLayout
from vllm_interp.steering.vectors import SiteBlock, SteeringVectors
from vllm_interp.uploads import copy_into, rows_to_device, to_device

GLOBAL_ROWS = {"prefill": 1, "decode": 2}
FIRST_SLOT_ROW = 3
NO_SLOT = -1  # the prefill row of a request without a config slot
SITE_LISTS_KEPT = 1024  # site-name lists whose coordinates a table remembers (names come from requests)


@lru_cache(maxsize=4096)  # site names seen by table writes: a few per layer (bounded: names come from requests)
def _site_index(name: str) -> tuple[int, int]:
    """``(layer, hook index)`` of a site name."""
    layer, hook = parse_site_name(name)
    return layer, HOOK_INDEX[hook]


Site = tuple[int, int]  # (layer, hook index)


def _sites(vectors: SteeringVectors) -> frozenset[Site]:
    """The sites ``vectors`` add to, in any tier."""
    return frozenset(_site_index(name) for sites in vectors.tiers.values() for name in sites)


def _held_rows(sites: Mapping[str, np.ndarray], held: list[int]) -> list[np.ndarray]:
    """The vectors of the sites at positions ``held`` of ``sites``, as ``[rows, hidden]`` views for the one copy
    into pinned memory: a request's own block whole when this worker holds every one of its sites, else a row
    each."""
    if isinstance(sites, SiteBlock) and len(held) == len(sites):
        return [sites.matrix]
    values = list(sites.values())
    return [values[i][None] for i in held]


def table_rows(max_configs: int) -> int:
    return FIRST_SLOT_ROW + 2 * max_configs


class SteeringSlotsExhausted(RuntimeError):
    pass


@dataclass
class _Slot:
    digest: str
    index: int
    vectors: SteeringVectors
    requests: set[str] = field(default_factory=set)
    sites: frozenset[Site] = frozenset()  # where the request's own vectors add

    def row(self, phase: Literal["prefill", "decode"]) -> int:
        return FIRST_SLOT_ROW + 2 * self.index + (phase == "decode")


class SteeringTables:
    def __init__(self, bank: SiteBank, max_configs: int) -> None:
        self.bank = bank
        self.max_configs = max_configs
        self.global_vectors = SteeringVectors()
        self._global_rows = {phase: 0 for phase in GLOBAL_ROWS}  # the row each phase's unsteered tokens take
        self._slots: dict[str, _Slot] = {}
        self._free = list(range(max_configs))
        self._by_req: dict[str, _Slot | None] = {}
        # Per request a step has looked up: its slot's prefill row (NO_SLOT: none) and its prompt length.
        self._step_facts: dict[str, tuple[int, int]] = {}
        self._loaded: np.ndarray | None = None  # the map the index buffer holds (in its first entries)
        self._pending: dict[int, SteeringVectors] = {}  # prefill row -> the vectors it and its decode row take
        self._steered_sites: frozenset[Site] | None = frozenset()  # None: stale since a slot or global change
        # The last step's batch (a copy: runners reuse their lists) and index, while the same batch's next step
        # takes that index again (see ``step_index``); None after any other step, and after a global change.
        self._steady: tuple[list[str], np.ndarray | None] | None = None
        self._site_coords: dict[tuple[str, ...], tuple[list[int], np.ndarray]] = {}

    # -- global state --------------------------------------------------------------------------------
    def set_global(self, vectors: SteeringVectors) -> None:
        self.global_vectors = vectors
        self._steered_sites = None
        self._steady = None
        self._pending[GLOBAL_ROWS["prefill"]] = vectors
        for phase, row in GLOBAL_ROWS.items():
            self._global_rows[phase] = row if vectors.phase_vectors(phase) else 0
        for slot in self._slots.values():
            self._write_slot(slot)
        self.upload_pending()

    # -- per request ---------------------------------------------------------------------------------
    def lookup(self, req_id: str, extra_args: dict[str, Any] | None) -> _Slot | None:
        if req_id in self._by_req:
            return self._by_req[req_id]
        wire = interp_args(extra_args).get("steering")
        slot = None
        if wire:
            vectors = SteeringVectors.from_wire(wire["vectors"])
            slot = self._slots.get(wire["digest"])
            if slot is None:
                if not self._free:
                    raise SteeringSlotsExhausted(
                        f"all {self.max_configs} steering config slots are in use (--max-steering-configs)"
                    )
                slot = _Slot(wire["digest"], self._free.pop(0), vectors, sites=_sites(vectors))
                self._slots[wire["digest"]] = slot
                self._steered_sites = None
                self._write_slot(slot)
            slot.requests.add(req_id)
        self._by_req[req_id] = slot
        return slot

    def forget_finished(self, live_req_ids: set[str]) -> None:
        for req_id in self._by_req.keys() - live_req_ids:
            slot = self._by_req.pop(req_id)
            self._step_facts.pop(req_id, None)
            if slot is not None:
                slot.requests.discard(req_id)
                if not slot.requests:
                    del self._slots[slot.digest]
                    self._free.append(slot.index)
                    self._steered_sites = None

    @property
    def steered_sites(self) -> frozenset[Site]:
        """The sites some token may be steered at (the global vectors' and those of configs holding a slot).
        Every table row a token can point to is zeros at the other sites, so an eager step adds only here:
        one layer's vector costs one site's add, not one per site of the model."""
        if self._steered_sites is None:
            self._steered_sites = _sites(self.global_vectors).union(*(slot.sites for slot in self._slots.values()))
        return self._steered_sites

    def repeats(self, req_ids: list[str], total_tokens: int) -> bool:
        """Whether a step of ``req_ids`` (``total_tokens`` tokens in all) takes the index the last step of the
        same batch took, which the buffer holds: ``step_index`` would answer it and ``load_index`` leave the
        buffer as it is. So it does when no token of the batch was steered (a slot or a global vector comes only
        with a new request or ``set_global``), and for a decode step of one token each after a decode step of
        the batch (positions only move on: every token stays past its prompt, at its decode row)."""
        steady = self._steady
        return steady is not None and req_ids == steady[0] and (steady[1] is None or total_tokens == len(req_ids))

    @property
    def steers(self) -> bool:
        """Whether the index buffer steers some token of the step it was loaded for."""
        return self._loaded is not None

    def step_index(self, layout: BatchLayout,
                   request: Callable[[str], tuple[dict[str, Any] | None, int]]) -> np.ndarray | None:
        """The step's table row of every token (None: none steered), with the step's new requests looked up
        and the slots of requests that left the batch freed first. ``request(req_id)``: its ``extra_args``
        and prompt length. Runs before every step: a step of the batch the last step ran that takes the same
        index (``_steady``: a decode step of a steered batch, any step of an unsteered one) costs a comparison
        of the request lists; other steps a membership test per request and, when some request is steered, a
        dictionary read per request and array operations."""
        req_ids = layout.req_ids
        if self.repeats(req_ids, layout.total_tokens):
            return self._steady[1]
        by_req, facts = self._by_req, self._step_facts
        new = [req_id for req_id in req_ids if req_id not in facts]  # (facts' keys are a subset of by_req's)
        if len(by_req) > len(req_ids) - len(new):  # some looked-up request is not in this batch
            self.forget_finished(set(req_ids))
        for req_id in new:
            extra_args, prompt_len = request(req_id)
            slot = self.lookup(req_id, extra_args)
            facts[req_id] = (NO_SLOT if slot is None else slot.row("prefill"), prompt_len)
        # A slot is held exactly while some looked-up request has it.
        if not self._slots and not any(self._global_rows.values()):
            # No token is steered, whatever the same batch schedules next (a slot or a global vector comes only
            # with a new request or ``set_global``).
            self._steady = (list(req_ids), None)
            return None
        pairs = np.fromiter(chain.from_iterable(map(facts.__getitem__, req_ids)), np.int64, 2 * len(req_ids))
        prompt_lens = pairs[1::2]
        index = self.plan(layout, prefill_rows=pairs[0::2], prompt_lens=prompt_lens)
        # A decode step of one token each, every one past its prompt: the same batch's next such step has its
        # tokens at the same decode rows (positions only move on), so it takes this index again.
        decoding = layout.total_tokens == len(req_ids) and bool((layout.position_starts >= prompt_lens).all())
        self._steady = (list(req_ids), index) if decoding else None
        return index

    def plan(self, layout: BatchLayout, prefill_rows: np.ndarray, prompt_lens: np.ndarray) -> np.ndarray | None:
        """Table row of every token of the step, or None when no token is steered (vectorised: this runs
        on the host before every step). ``prefill_rows``: each request's slot prefill row (its decode row is
        the next), ``NO_SLOT`` for a request without a config, which takes the global rows."""
        global_rows = self._global_rows
        has_slot = prefill_rows != NO_SLOT
        if not any(global_rows.values()) and not has_slot.any():
            return None
        prefill = np.where(has_slot, prefill_rows, global_rows["prefill"])
        decode = np.where(has_slot, prefill_rows + 1, global_rows["decode"])
        owner = np.repeat(np.arange(len(prefill_rows)), layout.num_tokens)
        positions = layout.position_starts[owner] + np.arange(owner.shape[0]) - layout.row_starts[owner]
        in_prompt = positions < prompt_lens[owner]
        return np.where(in_prompt, prefill[owner], decode[owner])

    def load_index(self, index: np.ndarray | None) -> None:
        """Write the step's token -> row map (None: no token steered). Entries a longer earlier map used go
        back to row 0: a replayed CUDA graph steers every row it holds, whatever the host-side plan says."""
        self.upload_pending()  # rows of the configs admitted for this step, before anything points at them
        loaded, self._loaded = self._loaded, index
        if index is loaded:  # a steady batch's step (``step_index``): the buffer holds its map already
            return
        if index is not None and loaded is not None and np.array_equal(index, loaded):
            return  # the same map planned again (a batch that was not steady): the buffer holds it already
        count = 0 if index is None else index.shape[0]
        used = 0 if loaded is None else loaded.shape[0]
        target = self.bank.steer_index
        if count:
            copy_into(target[:count], index)
        if used > count:
            target[count:used].zero_()

    # -- table writes --------------------------------------------------------------------------------
    def _write_slot(self, slot: _Slot) -> None:
        self._pending[slot.row("prefill")] = self.global_vectors + slot.vectors

    def upload_pending(self) -> None:
        """Write every queued prefill row and the decode row after it, in every held layer's table (zeros where
        the vectors have no site): two uploads and a few device ops, however many rows are queued.

        This runs on the forward thread before a step that admits requests with new vectors. Building and
        converting a zeroed block per config with torch CPU ops cost about 4 ms a config in an H100 server's
        engine core (0.3 ms in a process alone; likely each small CPU op waiting for the process's intra-op
        threads on a loaded host). So the host only lists the sites and copies the vectors once (numpy, a block
        per config); zeroing, the conversion to the table's dtype (the same rounding as on the host) and the
        scatter run on the table's device."""
        if not self._pending:
            return
        pending, self._pending = self._pending, {}
        rows = sorted({row + phase for row in pending for phase in (0, 1)})
        coords, blocks = self._sites_of(pending)
        table = self.bank.steer_table
        ints = to_device(np.concatenate([np.asarray(rows, np.int64), coords.ravel()]), table.device)
        table.index_fill_(2, ints[: len(rows)], 0)
        if blocks:
            layer_slots, hooks, at_rows, sources = ints[len(rows):].view(4, -1)
            values = rows_to_device(blocks, table.device)
            table[layer_slots, hooks, at_rows] = values[sources].to(table.dtype)

    def _sites_of(self, pending: dict[int, SteeringVectors]) -> tuple[np.ndarray, list[np.ndarray]]:
        """``[4, n]``: (layer slot, hook, table row, vector index) of every held site of the queued rows, and
        the vectors as ``[sites, hidden]`` blocks whose rows the vector indices count, each once (a config of
        base vectors alone puts the same vectors in both of its rows). A burst admits a hundred configs in a
        step, on the forward thread: each row's sites are mapped with array operations, from its site names'
        coordinates (the same few lists of names recur), and a request's own vectors arrive as one block."""
        parts: list[np.ndarray] = []
        blocks: list[np.ndarray] = []
        count = 0
        for prefill_row, queued in pending.items():
            for row, sites in self._phase_rows(prefill_row, queued):
                if sites is None:  # the decode row takes the prefill row's vectors
                    shared = parts[-1].copy()
                    shared[2] = row
                    parts.append(shared)
                    continue
                held, template = self._held_sites(tuple(sites))
                part = template.copy()
                part[2] = row
                part[3] += count
                parts.append(part)
                blocks.extend(_held_rows(sites, held))
                count += len(held)
        return (np.concatenate(parts, axis=1) if parts else np.empty((4, 0), np.int64)), blocks

    @staticmethod
    def _phase_rows(prefill_row: int, queued: SteeringVectors) -> list[tuple[int, Mapping[str, np.ndarray] | None]]:
        """Each of a config's two rows with its sites' vectors (the decode row: None when it equals the prefill
        row, which a config without prefill or decode tiers does)."""
        split = queued.tiers.get("prefill") or queued.tiers.get("decode")
        return [(prefill_row, queued.phase_vectors("prefill")),
                (prefill_row + 1, queued.phase_vectors("decode") if split else None)]

    def _held_sites(self, names: tuple[str, ...]) -> tuple[list[int], np.ndarray]:
        """Which of ``names`` this worker's layers hold (another pipeline stage holds the rest), and the
        ``[4, n]`` coordinates of a row setting them from vectors 0..n-1 (its table row still 0); remembered
        per list of names."""
        found = self._site_coords.get(names)
        if found is None:
            local = self.bank.layer_index
            sites = [_site_index(name) for name in names]
            held = [i for i, (layer, _) in enumerate(sites) if layer in local]
            template = np.zeros((4, len(held)), np.int64)
            template[0] = [local[sites[i][0]] for i in held]
            template[1] = [sites[i][1] for i in held]
            template[3] = np.arange(len(held))
            found = (held, template)
            if len(self._site_coords) < SITE_LISTS_KEPT:
                self._site_coords[names] = found
        return found
