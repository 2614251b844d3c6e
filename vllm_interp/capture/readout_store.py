"""Worker side of the read-out: per-request rows gathered after each step, handed out by RPC."""

from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_interp.capture.readout import ReadoutSpec, readout_to_wire, validate_readout_spec
from vllm_interp.engine.row_plan import ReadPlan
from vllm_interp.hooks import HOOK_INDEX, parse_site_name
from vllm_interp.models.registry import SiteBank
from vllm_interp.request_args import interp_args


@dataclass
class _RequestReadout:
    key: str
    spec: ReadoutSpec
    prompt_len: int
    sites: list[tuple[int, int]]  # (layer, hook index) held on this rank
    site_names: list[str]
    rows: dict[int, torch.Tensor] = field(default_factory=dict)  # position -> [sites, hidden]
    num_computed: int = 0
    overflow: int = 0


class ReadoutStore:
    def __init__(self, bank: SiteBank, num_layers: int, max_rows: int) -> None:
        self.bank = bank
        self.num_layers = num_layers
        self.max_rows = max_rows
        self._by_req: dict[str, _RequestReadout | None] = {}
        self._by_key: dict[str, _RequestReadout] = {}
        self._dirty_rows = 0

    def lookup(self, req_id: str, extra_args: dict[str, Any] | None, prompt_len: int) -> _RequestReadout | None:
        if req_id in self._by_req:
            return self._by_req[req_id]
        args = interp_args(extra_args)
        entry = None
        if "readout" in args:
            # A preempted request comes back under the same key: keep the rows it already has.
            entry = self._by_key.get(args["readout_key"])
            if entry is None:
                spec = validate_readout_spec(args["readout"], num_layers=self.num_layers)
                held = set(self.bank.layers)
                names = [n for n in spec.site_names(self.num_layers) if parse_site_name(n)[0] in held]
                sites = [(layer, HOOK_INDEX[hook]) for layer, hook in map(parse_site_name, names)]
                entry = _RequestReadout(args["readout_key"], spec, prompt_len, sites, names)
                self._by_key[entry.key] = entry
        self._by_req[req_id] = entry
        return entry

    def forget_finished(self, live_req_ids: set[str]) -> None:
        """Drop per-request lookups for requests that left the batch (their rows stay until taken)."""
        for req_id in self._by_req.keys() - live_req_ids:
            del self._by_req[req_id]

    def note_progress(self, req_id: str, num_computed: int) -> None:
        entry = self._by_req.get(req_id)
        if entry is not None:
            entry.num_computed = max(entry.num_computed, num_computed)

    def load_rows(self, plan: ReadPlan) -> None:
        """Write the plan into the rows buffer; slots a longer earlier plan used go back to row 0, which
        exists in every batch, so a replayed CUDA graph that reads all slots stays in bounds."""
        rows = self.bank.rows
        if plan.num_rows:
            rows[: plan.num_rows].copy_(torch.from_numpy(plan.rows), non_blocking=True)
        if self._dirty_rows > plan.num_rows:
            rows[plan.num_rows : self._dirty_rows].zero_()
        self._dirty_rows = plan.num_rows

    def collect(self, plan: ReadPlan) -> None:
        """Copy this step's planned rows out of the site buffers (call after the forward)."""
        for req_id, count in plan.overflow.items():
            self._by_req[req_id].overflow += count
        for reads in plan.reads:
            entry = self._by_req[reads.req_id]
            if not entry.sites:
                continue
            stop = reads.slot_start + len(reads.positions)
            block = torch.stack([self.bank.outs[layer][hook, reads.slot_start : stop] for layer, hook in entry.sites])
            block = block.to("cpu", copy=True)  # [sites, k, hidden]
            for j, position in enumerate(reads.positions.tolist()):
                entry.rows[position] = block[:, j]

    def take(self, keys: list[str]) -> dict[str, dict[str, Any]]:
        return {key: self._take_one(key) for key in keys if key in self._by_key}

    def _take_one(self, key: str) -> dict[str, Any]:
        entry = self._by_key.pop(key)
        if entry.overflow:
            return {
                "error": f"{entry.overflow} rows did not fit the per-step read buffer "
                f"(max_readout_rows={self.max_rows}); raise max_readout_rows or lower max_num_batched_tokens"
            }
        expected = entry.spec.expected_positions(entry.prompt_len, entry.num_computed)
        if isinstance(entry.spec.positions, list):
            beyond = sorted(set(entry.spec.positions) - set(expected))
            if beyond:
                return {
                    "error": f"positions {beyond} were never computed: the sequence went through the model "
                    f"for {entry.num_computed} tokens (the last generated token is never fed back)"
                }
        missing = sorted(set(expected) - set(entry.rows))
        if missing:
            return {"error": f"positions {missing[:8]}{'...' if len(missing) > 8 else ''} were not computed "
                    "by this engine (served from the prefix cache?)"}
        if not entry.sites:
            return {"positions": expected, "sites": [], "shape": [len(expected), 0, 0], "dtype": "float32",
                    "data": b"", "error": None}
        hidden = self.bank.outs[self.bank.layers[0]].shape[-1]
        empty = torch.empty(0, len(entry.sites), hidden)
        block = torch.stack([entry.rows[p] for p in expected]) if expected else empty
        return readout_to_wire(expected, entry.site_names, block)
