"""Source runs for patching, in worker memory: what the ``patch_source`` consumer stored, by run id.

One store per worker process (``SOURCES``), filled by the consumer's thread and read by the runner when a
patched request arrives. A run's ``generation`` is a digest of its contents, so the frontend can tell a
run re-captured under the same id from the one a request was admitted against (and the prefix cache never
shares KV between them). Runs are evicted least recently used first once the byte budget is exceeded;
a run leased by a request that has arrived but not finished is never evicted (deleting it is allowed: an
explicit delete fails the requests that have not resolved their rows yet, never patches them wrongly).
"""

import hashlib
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

DEFAULT_BUDGET_BYTES = 1 << 30


class SourceBudgetExceeded(RuntimeError):
    pass


@dataclass
class SourceRun:
    run_id: str
    prompt_len: int
    positions: list[int]
    tensors: dict[str, torch.Tensor]  # site name -> [len(positions), hidden] (host memory)
    generation: str = ""
    created: float = field(default_factory=time.time)
    leases: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self._column = {position: i for i, position in enumerate(self.positions)}
        if not self.generation:
            h = hashlib.sha256(repr(self.positions).encode())
            for name in sorted(self.tensors):
                h.update(name.encode())
                h.update(self.tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
            self.generation = h.hexdigest()[:24]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def row(self, site: str, position: int) -> torch.Tensor | None:
        tensor, column = self.tensors.get(site), self._column.get(position)
        return None if tensor is None or column is None else tensor[column]

    def describe(self) -> dict:
        return {"run_id": self.run_id, "generation": self.generation, "prompt_len": self.prompt_len,
                "positions": self.positions, "sites": sorted(self.tensors), "bytes": self.nbytes,
                "leases": len(self.leases), "created": self.created}


class SourceStore:
    def __init__(self, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> None:
        self.budget_bytes = budget_bytes
        self._runs: OrderedDict[str, SourceRun] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, run: SourceRun) -> list[str]:
        """Store ``run`` (replacing one with its id); returns the ids evicted to make room."""
        with self._lock:
            if run.nbytes > self.budget_bytes:
                raise SourceBudgetExceeded(
                    f"run {run.run_id!r} needs {run.nbytes} bytes, more than --patch-source-bytes "
                    f"({self.budget_bytes})")
            old = self._runs.pop(run.run_id, None)
            if old is not None:
                run.leases = old.leases
            evicted = []
            for victim in list(self._runs.values()):
                if self._used() + run.nbytes <= self.budget_bytes:
                    break
                if not victim.leases:
                    del self._runs[victim.run_id]
                    evicted.append(victim.run_id)
            if self._used() + run.nbytes > self.budget_bytes:
                raise SourceBudgetExceeded(
                    f"run {run.run_id!r} ({run.nbytes} bytes) does not fit: the stored runs left are leased by "
                    "requests in flight (--patch-source-bytes)")
            self._runs[run.run_id] = run
            return evicted

    def _used(self) -> int:
        return sum(r.nbytes for r in self._runs.values())

    def acquire(self, run_id: str, generations: list[str], req_id: str) -> SourceRun | None:
        """The run a request was admitted against (its generation is among ``generations``), leased to
        ``req_id`` and marked recently used; None if it is gone or was replaced."""
        with self._lock:
            run = self._runs.get(run_id)
            if run is None or run.generation not in generations:
                return None
            run.leases.add(req_id)
            self._runs.move_to_end(run_id)
            return run

    def release(self, req_id: str) -> None:
        with self._lock:
            for run in self._runs.values():
                run.leases.discard(req_id)

    def delete(self, run_id: str) -> bool:
        with self._lock:
            return self._runs.pop(run_id, None) is not None

    def describe(self) -> dict[str, dict]:
        with self._lock:
            return {run_id: run.describe() for run_id, run in self._runs.items()}


SOURCES = SourceStore()
