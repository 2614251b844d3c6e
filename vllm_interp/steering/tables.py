"""Worker side of steering: per-layer tables of summed vectors, and the table row of every token.

Each layer holds ``table[hook, row]``. Row 0 is zeros (unsteered tokens), rows 1 and 2 the global prefill
and decode vectors (global base + tier), and each per-request config slot ``s`` owns rows ``3 + 2s``
(prefill) and ``4 + 2s`` (decode), which already include the global vectors. Identical request specs share
a slot; a slot is freed when its last request leaves the batch. Tables change only by in-place writes, so
compiled graphs see them.
"""

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from vllm_interp.hooks import HOOK_INDEX, parse_site_name
from vllm_interp.models.registry import SiteBank
from vllm_interp.request_args import interp_args
from vllm_interp.row_plan import BatchLayout
from vllm_interp.steering.vectors import SteeringVectors
from vllm_interp.uploads import copy_into

GLOBAL_ROWS = {"prefill": 1, "decode": 2}
FIRST_SLOT_ROW = 3


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
        self._dirty = 0

    # -- global state --------------------------------------------------------------------------------
    def set_global(self, vectors: SteeringVectors) -> None:
        self.global_vectors = vectors
        self._write_rows(GLOBAL_ROWS["prefill"], vectors)
        for phase, row in GLOBAL_ROWS.items():
            self._global_rows[phase] = row if vectors.phase_vectors(phase) else 0
        for slot in self._slots.values():
            self._write_slot(slot)

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
                slot = _Slot(wire["digest"], self._free.pop(0), vectors)
                self._slots[wire["digest"]] = slot
                self._write_slot(slot)
            slot.requests.add(req_id)
        self._by_req[req_id] = slot
        return slot

    def forget_finished(self, live_req_ids: set[str]) -> None:
        for req_id in self._by_req.keys() - live_req_ids:
            slot = self._by_req.pop(req_id)
            if slot is not None:
                slot.requests.discard(req_id)
                if not slot.requests:
                    del self._slots[slot.digest]
                    self._free.append(slot.index)

    def plan(self, layout: BatchLayout, prompt_lens: list[int], slots: list[_Slot | None]) -> np.ndarray | None:
        """Table row of every token of the step, or None when no token is steered (vectorised: this runs
        on the host before every step)."""
        global_rows = self._global_rows
        if not any(global_rows.values()) and not any(slots):
            return None
        prefill_rows = np.array([s.row("prefill") if s else global_rows["prefill"] for s in slots], dtype=np.int64)
        decode_rows = np.array([s.row("decode") if s else global_rows["decode"] for s in slots], dtype=np.int64)
        owner = np.repeat(np.arange(len(slots)), layout.num_tokens)
        positions = layout.position_starts[owner] + np.arange(owner.shape[0]) - layout.row_starts[owner]
        in_prompt = positions < np.asarray(prompt_lens)[owner]
        return np.where(in_prompt, prefill_rows[owner], decode_rows[owner])

    def load_index(self, index: np.ndarray | None) -> None:
        """Write the step's token -> row map (None: no token steered). Entries a longer earlier map used go
        back to row 0: a replayed CUDA graph steers every row it holds, whatever the host-side plan says."""
        count = 0 if index is None else index.shape[0]
        target = self.bank.steer_index
        if count:
            copy_into(target[:count], index)
        if self._dirty > count:
            target[count : self._dirty].zero_()
        self._dirty = count

    # -- table writes --------------------------------------------------------------------------------
    def _write_slot(self, slot: _Slot) -> None:
        self._write_rows(slot.row("prefill"), self.global_vectors + slot.vectors)

    def _write_rows(self, prefill_row: int, vectors: SteeringVectors) -> None:
        """The prefill row and the decode row after it, of every held layer's table, in one upload (zeros
        where ``vectors`` has no site). Built in the table's dtype, converting only the sites that steer: this
        runs on the forward thread when a request with new vectors is admitted."""
        table = self.bank.steer_table
        block = torch.zeros((table.shape[0], table.shape[1], 2, table.shape[3]), dtype=table.dtype)
        self._fill(block[:, :, 0], vectors.phase_vectors("prefill"))
        if vectors.tiers.get("prefill") or vectors.tiers.get("decode"):
            self._fill(block[:, :, 1], vectors.phase_vectors("decode"))
        else:  # base vectors alone: both phases add the same
            block[:, :, 1] = block[:, :, 0]
        copy_into(table[:, :, prefill_row : prefill_row + 2], block)

    def _fill(self, block: torch.Tensor, vectors: dict[str, np.ndarray]) -> None:
        """Set ``block[layer slot, hook]`` to each held site's vector, in one conversion and one indexed write."""
        local = self.bank.layer_index
        sites = [(local[layer], HOOK_INDEX[hook], vector) for name, vector in vectors.items()
                 for layer, hook in [parse_site_name(name)] if layer in local]  # else another stage holds it
        if sites:
            layers, hooks, rows = zip(*sites, strict=True)
            block[list(layers), list(hooks)] = torch.from_numpy(np.stack(rows)).to(block.dtype)
