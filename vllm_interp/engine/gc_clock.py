"""The engine process's garbage collections, counted and timed per generation (``gc.callbacks``).

A collection pauses whichever thread's allocation set it off, in the middle of whatever it was doing, so a
sampling profiler spreads its time over every function that allocates: a workload that keeps more objects
alive makes the whole step look slower. The worker reports these counts (``interp_capture_steps``) so that
the serving benchmarks can tell collector pauses from a phase's own work.
"""

import gc
import time
from typing import Any

GENERATIONS = 3


class GcClock:
    """A ``gc.callbacks`` entry: per generation, the collections that ran and their time in all."""

    def __init__(self) -> None:
        self.collections = [0] * GENERATIONS
        self.seconds = [0.0] * GENERATIONS
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        generation = info["generation"]
        self.collections[generation] += 1
        self.seconds[generation] += time.perf_counter() - self._started

    def counts(self) -> dict[str, float]:
        """``gc0``..``gc2`` (collections so far) and ``gc0_ms``..``gc2_ms`` (their time)."""
        counts: dict[str, float] = {}
        for generation in range(GENERATIONS):
            counts[f"gc{generation}"] = self.collections[generation]
            counts[f"gc{generation}_ms"] = self.seconds[generation] * 1000
        return counts


GC_CLOCK = GcClock()  # this process's (a collection runs one at a time, under the interpreter lock)


def start_gc_clock() -> GcClock:
    """Time this process's collections from now on (once; later calls return the same clock)."""
    if GC_CLOCK not in gc.callbacks:
        gc.callbacks.append(GC_CLOCK)
    return GC_CLOCK
