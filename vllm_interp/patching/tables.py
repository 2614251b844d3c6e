"""Worker side of patching: each request's resolved patches, and the rows each step writes.

A patched request's spec is decoded once, when it arrives: vectors go to the device, rows of source runs
are copied out of the source store (so a run deleted later cannot change a request that has its rows).
Before every step, the patches whose position falls in the step's slice of each request get a slot of the
shared value table (``SiteBank.patch_values``/``patch_alpha``) and their (layer, hook, token row) entry of
``SiteBank.patch_index`` points at it; last step's entries go back to 0 first. Only in-place writes, so
compiled graphs and CUDA graphs see them.

A request whose patches cannot all be applied (a source run gone, a position past its prompt, more patch
rows in one step than there are slots) is never patched partly: it gets no patch at all and an ``error``
status, which every front door turns into an error for that request.
"""

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from vllm_interp.capture.results import ConsumerResult
from vllm_interp.hooks import HOOK_INDEX, site_name
from vllm_interp.models.registry import SiteBank
from vllm_interp.models.site_ops import StepPatches
from vllm_interp.patching.sources import SourceRun, SourceStore
from vllm_interp.patching.spec import PatchSpec
from vllm_interp.request_args import interp_args
from vllm_interp.row_plan import BatchSlice
from vllm_interp.uploads import rows_to_device, to_device

# The name under which a request's patch status travels with its capture results.
PATCH_RESULT = "patch"
MAX_UNCLAIMED_STATUSES = 4096


@dataclass
class _Patched:
    key: str | None
    layer_slots: np.ndarray  # index of each patch's layer in SiteBank.layers
    hooks: np.ndarray
    positions: np.ndarray
    alphas: torch.Tensor  # [k] on the device
    values: torch.Tensor  # [k, hidden] on the device
    error: str | None = None
    applied: set[int] = field(default_factory=set)  # patch indices written at least once


class PatchTables:
    def __init__(self, bank: SiteBank, sources: SourceStore) -> None:
        self.bank = bank
        self.sources = sources
        self._by_req: dict[str, _Patched | None] = {}
        self._by_key: dict[str, str] = {}
        self._statuses: dict[str, ConsumerResult] = {}
        self._dirty: tuple[torch.Tensor, ...] | None = None
        self.patched_ids: set[str] = set()  # requests with patches to apply (the runner plans these alone)

    @property
    def slots(self) -> int:
        return self.bank.patch_values.shape[0] - 1

    def lookup(self, req_id: str, extra_args: dict[str, Any] | None, prompt_len: int) -> _Patched | None:
        if req_id in self._by_req:
            return self._by_req[req_id]
        args = interp_args(extra_args)
        wire = args.get("patch")
        patched = None if not wire else self._resolve(req_id, PatchSpec.from_wire(wire), prompt_len,
                                                      args.get("capture_key"))
        self._by_req[req_id] = patched
        if patched is not None and patched.error is None and len(patched.positions):
            self.patched_ids.add(req_id)
        if patched is not None and patched.key is not None:
            self._by_key[patched.key] = req_id
        return patched

    def _resolve(self, req_id: str, spec: PatchSpec, prompt_len: int, key: str | None) -> _Patched:
        bank = self.bank
        width, dtype, device = bank.patch_values.shape[1], bank.patch_values.dtype, bank.patch_values.device
        mine = [e for e in spec.entries if e.layer in self.bank.layer_index]  # other pipeline stages patch the rest
        error = None
        rows = []
        runs = {}
        for entry in mine:
            if entry.position >= prompt_len:
                error = f"position {entry.position} is not a prompt position (the prompt has {prompt_len} tokens)"
                break
            if entry.vector is not None:
                rows.append(entry.vector)
                continue
            if entry.run not in runs:
                runs[entry.run] = self.sources.acquire(entry.run, spec.run_generations[entry.run].split("|"), req_id)
            run, site = runs[entry.run], site_name(entry.layer, entry.hook)
            row = None if run is None else run.row(site, entry.run_position)
            if row is None:
                error = _missing_row(entry.run, run, site, entry.run_position)
                break
            rows.append(row.float().numpy())
        if error is None and len(mine) > self.slots:
            error = f"{len(mine)} patches exceed the {self.slots} patch slots of a step (--max-patch-rows)"
        self.sources.release(req_id)  # the rows are copied below: the request no longer needs the runs
        if error is not None or not mine:
            mine, rows = [], []
        # Staged through pinned memory and converted on the device: a plain ``.to(device)`` from pageable memory
        # would make the stream wait for the step in flight, on every patched request's admission.
        values = (rows_to_device([row[None] for row in rows], device).to(dtype) if rows
                  else torch.zeros(0, width, dtype=dtype, device=device))
        return _Patched(
            key=key,
            layer_slots=np.array([self.bank.layer_index[e.layer] for e in mine], dtype=np.int64),
            hooks=np.array([HOOK_INDEX[e.hook] for e in mine], dtype=np.int64),
            positions=np.array([e.position for e in mine], dtype=np.int64),
            alphas=to_device(np.array([e.alpha for e in mine], dtype=np.float32), device).to(dtype),
            values=values,
            error=error,
        )

    def finish(self, finished_req_ids: set[str]) -> None:
        """The scheduler reported these requests finished: keep their status until the caller asks."""
        for req_id in finished_req_ids:
            patched = self._by_req.pop(req_id, None)
            self.patched_ids.discard(req_id)
            if patched is not None and patched.key is not None and self._by_key.pop(patched.key, None):
                self._statuses[patched.key] = _status(patched)
        while len(self._statuses) > MAX_UNCLAIMED_STATUSES:  # callers that went away never ask
            self._statuses.pop(next(iter(self._statuses)))

    @property
    def quiet(self) -> bool:
        """No request has patches to apply and the last step's patch entries are cleared: a step needs no plan."""
        return not self.patched_ids and self._dirty is None

    def plan(self, slices: list[BatchSlice]) -> StepPatches | None:
        """Write this step's patch rows into the site op's buffers (which a replayed CUDA graph reads), and
        return them per site (which the op applies directly when it runs eagerly); None: nothing patched."""
        bank = self.bank
        if self._dirty is not None:
            bank.patch_index[self._dirty] = 0
            self._dirty = None
        layer_slots, hooks, rows, values, alphas = [], [], [], [], []
        count = 0
        for batch_slice in slices:
            patched = self._by_req.get(batch_slice.req_id)
            if patched is None or patched.error is not None or not len(patched.positions):
                continue
            start = batch_slice.position_start
            here = np.flatnonzero((patched.positions >= start) & (patched.positions < start + batch_slice.num_tokens))
            if not len(here):
                continue
            if count + len(here) > self.slots:
                # Never patched in part: the request fails (and is patched no further) rather than run half-patched.
                patched.error = (f"the step's patch rows exceeded the {self.slots} patch slots "
                                 "(--max-patch-rows); send fewer patched requests at once")
                continue
            count += len(here)
            layer_slots.append(patched.layer_slots[here])
            hooks.append(patched.hooks[here])
            rows.append(batch_slice.row_start + patched.positions[here] - start)
            picked = to_device(here, patched.values.device)
            values.append(patched.values.index_select(0, picked))
            alphas.append(patched.alphas.index_select(0, picked))
            patched.applied.update(here.tolist())
        if not rows:
            return None
        device = bank.patch_index.device
        layer_slots, hooks, rows = (np.concatenate(a) for a in (layer_slots, hooks, rows))
        values, alphas = torch.cat(values), torch.cat(alphas)
        index = tuple(to_device(a, device) for a in (layer_slots, hooks, rows))
        bank.patch_values[1 : count + 1].copy_(values)
        bank.patch_alpha[1 : count + 1].copy_(alphas)
        bank.patch_index[index] = torch.arange(1, count + 1, device=device)
        self._dirty = index
        sites: StepPatches = {}
        for layer_slot, hook in {(int(a), int(b)) for a, b in zip(layer_slots, hooks, strict=True)}:
            picked = np.flatnonzero((layer_slots == layer_slot) & (hooks == hook))
            at = to_device(picked, device)
            sites[(bank.layers[layer_slot], hook)] = (to_device(rows[picked], device),
                                                      values.index_select(0, at), alphas.index_select(0, at))
        return sites

    def statuses(self, keys: list[str]) -> dict[str, dict[str, Any]]:
        """The patch status of the requests with these keys, which the caller has seen complete (so every
        prompt position was computed, even if the scheduler has not reported them finished yet). Asked once:
        a status is forgotten when returned."""
        out = {}
        for key in keys:
            if key in self._statuses:
                out[key] = self._statuses.pop(key).model_dump()
            elif (req_id := self._by_key.pop(key, None)) is not None:
                out[key] = _status(self._by_req[req_id]).model_dump()
        return out


def _missing_row(run_id: str, run: SourceRun | None, site: str, position: int) -> str:
    if run is None:
        return (f"source run {run_id!r} no longer holds {site} at position {position} (deleted, evicted or "
                "re-captured since the request was admitted)")
    return f"source run {run_id!r} holds no {site} at position {position} (it captured positions {run.positions})"


def _status(patched: _Patched) -> ConsumerResult:
    if patched.error is not None:
        return ConsumerResult.failed(f"patch not applied: {patched.error}")
    missing = len(patched.positions) - len(patched.applied)
    if missing:
        return ConsumerResult.failed(f"patch not applied: {missing} patched positions were never computed")
    return ConsumerResult(status="ok", rows=len(patched.positions))
