"""The engine process's garbage-collection clock: each collection counted and timed under its generation."""

import gc

from vllm_interp.engine.gc_clock import GC_CLOCK, start_gc_clock


def test_each_collection_is_counted_and_timed_under_its_generation():
    clock = start_gc_clock()
    assert clock is GC_CLOCK and start_gc_clock() is clock and gc.callbacks.count(clock) == 1
    gc.disable()  # only the collections asked for below
    try:
        before = clock.counts()
        gc.collect(2)
        gc.collect(0)
        after = clock.counts()
    finally:
        gc.enable()
    assert after["gc2"] - before["gc2"] == 1 and after["gc0"] - before["gc0"] == 1
    assert after["gc1"] == before["gc1"]
    assert after["gc2_ms"] > before["gc2_ms"] and after["gc0_ms"] > before["gc0_ms"]
