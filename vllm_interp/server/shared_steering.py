"""Global and named steering vectors shared by every API server of one ``vllm-interp serve``.

With ``--api-server-count N`` vLLM runs N API-server processes in front of one engine, each with its own
``SteeringState``; a request must see the same global vectors (they go into its prefix-cache salt) and the same
named vectors wherever it lands. ``vllm-interp serve`` makes a private directory before vLLM starts its API
servers and names it in ``VLLM_INTERP_SHARED_STEERING``; every API server then keeps its state in step with it:

- ``lock``: held (``fcntl.flock``, plus an asyncio lock within a process) around every change, the workers'
  RPC included, so changes apply in one order everywhere;
- ``state.npz``: the global and named vectors after the last change, replaced atomically;
- ``generation``: an 8-byte counter mapped into every API server's memory, bumped after each change.

Before a request is prepared and before a steering endpoint answers, ``refresh`` compares the counter with the
generation its server last loaded (one memory read) and reloads ``state.npz`` only when it moved. A change made
through one server is seen by a request on another that arrives after the change returned; one arriving while
it is in flight may still be prepared under the old vectors, as on a single server (docs/steering.md).
"""

import asyncio
import fcntl
import mmap
import os
import struct
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

from vllm_interp.steering.state import SteeringState
from vllm_interp.steering.vectors import SteeringVectors

ENV = "VLLM_INTERP_SHARED_STEERING"
_COUNTER = struct.Struct("<Q")


class SharedSteering:
    """One API server's view of the shared directory, around its ``SteeringState``."""

    @classmethod
    def for_server(cls, state: SteeringState) -> "SharedSteering":
        """The directory ``vllm-interp serve`` named; else (an API server started some other way, alone) one
        of this process's own, removed when it exits."""
        directory = os.environ.get(ENV)
        if directory:
            return cls(Path(directory), state)
        own = tempfile.TemporaryDirectory(prefix="vllm-interp-steering-")
        shared = cls(Path(own.name), state)
        shared._own_directory = own
        return shared

    def __init__(self, directory: Path, state: SteeringState) -> None:
        self.directory = directory
        self.state = state
        self._lock_fd = os.open(directory / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        counter_fd = os.open(directory / "generation", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(counter_fd).st_size < _COUNTER.size:
                os.ftruncate(counter_fd, _COUNTER.size)  # zeros: generation 0, nothing stored yet
            self._counter = mmap.mmap(counter_fd, _COUNTER.size)
        finally:
            os.close(counter_fd)
        self._seen = 0
        self._changing = asyncio.Lock()

    def _generation(self) -> int:
        return _COUNTER.unpack_from(self._counter)[0]

    def refresh(self) -> None:
        """Load the shared vectors if another server changed them since this one last looked."""
        generation = self._generation()
        if generation != self._seen:
            self._load()
            self._seen = generation

    async def change(self, action: Callable[[], Awaitable[Any]]) -> Any:
        """Run ``action`` (it plans against this server's state, pushes to the workers and commits) with every
        other change held off, on the latest shared state; then publish the result."""
        async with self._changing:
            await asyncio.to_thread(fcntl.flock, self._lock_fd, fcntl.LOCK_EX)
            try:
                self.refresh()
                result = await action()
                self._publish()
                return result
            finally:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def adopt_or_publish(self) -> None:
        """At start-up: take the shared vectors if an earlier server published some, else publish this one's
        (its ``--steering-vectors`` files), so the servers start alike whichever starts first."""
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        try:
            if self._generation():
                self.refresh()
            else:
                self._publish()
        finally:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    # -- the file ------------------------------------------------------------------------------------
    def _publish(self) -> None:
        """Store this server's state and bump the counter past it (the caller holds the file lock)."""
        self._store()
        self._seen = self._generation() + 1
        _COUNTER.pack_into(self._counter, 0, self._seen)

    def _store(self) -> None:
        arrays = {f"global/{tier}/{site}": vector for tier, sites in self.state.global_vectors.tiers.items()
                  for site, vector in sites.items()}
        for name, vectors in self.state.named.items():
            arrays.update({f"named/{name}/{tier}/{site}": vector for tier, sites in vectors.tiers.items()
                           for site, vector in sites.items()})
        temporary = self.directory / "state.tmp.npz"
        np.savez(temporary, **arrays)
        os.replace(temporary, self.directory / "state.npz")

    def _load(self) -> None:
        global_tiers: dict[str, dict[str, np.ndarray]] = {}
        named: dict[str, dict[str, dict[str, np.ndarray]]] = {}
        with np.load(self.directory / "state.npz", allow_pickle=False) as stored:
            for key in stored.files:
                # Names, tiers and site names hold no "/" (steering.state.VECTOR_NAME, hooks.site_name).
                owner, *rest = key.split("/")
                if owner == "global":
                    tier, site = rest
                    global_tiers.setdefault(tier, {})[site] = stored[key]
                else:
                    name, tier, site = rest
                    named.setdefault(name, {}).setdefault(tier, {})[site] = stored[key]
        self.state.commit(SteeringVectors(global_tiers))
        self.state.named = {name: SteeringVectors(tiers) for name, tiers in named.items()}
