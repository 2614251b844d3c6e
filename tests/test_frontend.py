"""The event-loop side of result collection, without an engine: one ``ResultsPoller`` asks the workers for every
awaited capture key in one call per round (streams that end together in its first), polls again soon while
keys are new, hands each collector only its own keys, drops callers that went away, and gives every caller of a
failed round the error."""

import asyncio
import time

from vllm_interp.capture.consumer import CaptureConsumer
from vllm_interp.capture.results import ResultCollector
from vllm_interp.frontend import ResultsPoller


class Workers:
    """Answers a key on the ``ready_after``-th call that asks for it; records every call's keys."""

    def __init__(self, ready_after: int = 2, fail: bool = False) -> None:
        self.calls: list[set[str]] = []
        self.asked: dict[str, int] = {}
        self.ready_after, self.fail = ready_after, fail

    async def rpc(self, pending: dict[str, int], wait_s: float) -> list[dict]:
        await asyncio.sleep(0)
        self.calls.append(set(pending))
        if self.fail:
            raise RuntimeError("engine gone")
        answers = {}
        for key in pending:
            self.asked[key] = self.asked.get(key, 0) + 1
            if self.asked[key] >= self.ready_after:
                answers[key] = {"inline": {"status": "ok", "result": {"key": key}}}
        return [answers]  # one rank


def _collector(*keys: str) -> ResultCollector:
    return ResultCollector(dict.fromkeys(keys, 5), {key: ["inline"] for key in keys})


def test_collectors_awaiting_together_share_each_round_and_get_their_own_keys():
    workers = Workers(ready_after=2)
    poller = ResultsPoller(workers.rpc, interval_s=0.001)
    collectors = [_collector("a"), _collector("b", "c"), _collector("d")]

    async def main():
        await asyncio.gather(*(poller.collect(c) for c in collectors))

    asyncio.run(main())
    # Polled one by one, each collector would have made two calls; together they make two in all.
    assert workers.calls == [{"a", "b", "c", "d"}] * 2
    for collector in collectors:
        assert not collector.pending
        merged = collector.merged({"inline": CaptureConsumer})
        assert sorted(merged) == sorted(collector.lengths)
        assert all(r["inline"].result == {"key": key} for key, r in merged.items())


def test_streams_ending_together_share_the_first_round_and_new_keys_are_asked_again_soon():
    """Callers arriving while the first round gathers join it; a key's rounds follow each other at the short
    interval while it is new (here the long one would not end within the test)."""
    workers = Workers(ready_after=5)
    poller = ResultsPoller(workers.rpc, interval_s=60.0, first_interval_s=0.001, first_window_s=5.0, gather_s=0.05)

    async def main():
        first = asyncio.create_task(poller.collect(_collector("a")))
        await asyncio.sleep(0.001)  # a few event-loop turns later, as the next stream's end of stream comes
        await asyncio.gather(first, poller.collect(_collector("b")))

    started = time.monotonic()
    asyncio.run(main())
    assert time.monotonic() - started < 10
    assert workers.calls == [{"a", "b"}] * 5


def test_keys_waiting_past_the_first_window_are_asked_at_the_long_interval():
    workers = Workers(ready_after=3)
    poller = ResultsPoller(workers.rpc, interval_s=0.2, first_interval_s=0.001, first_window_s=0.0, gather_s=0.0)
    started = time.monotonic()
    asyncio.run(poller.collect(_collector("a")))
    assert workers.calls == [{"a"}] * 3 and time.monotonic() - started >= 0.4


def test_a_caller_that_went_away_is_dropped_and_a_failed_round_fails_its_callers():
    workers = Workers(ready_after=3)
    poller = ResultsPoller(workers.rpc, interval_s=0.001)

    async def main():
        leaving = asyncio.create_task(poller.collect(_collector("gone")))
        staying = _collector("kept")
        await asyncio.sleep(0)
        leaving.cancel()
        await poller.collect(staying)
        return staying

    assert not asyncio.run(main()).pending
    assert workers.calls[-1] == {"kept"}  # the cancelled caller's key is no longer asked for

    failing = ResultsPoller(Workers(fail=True).rpc, interval_s=0.001)

    async def both():
        return await asyncio.gather(failing.collect(_collector("x")), failing.collect(_collector("y")),
                                    return_exceptions=True)

    assert [str(e) for e in asyncio.run(both())] == ["engine gone", "engine gone"]


def test_time_runs_out_with_keys_still_pending():
    poller = ResultsPoller(Workers(ready_after=10 ** 6).rpc, interval_s=0.001)
    collector = _collector("slow")
    asyncio.run(poller.collect(collector, timeout_s=0.01))
    assert collector.pending == {"slow": 5}


def test_keys_asked_for_early_wait_for_the_patient_interval_until_hurried():
    """A patient key (a stream's prompt-only results, asked for while it generates) is not asked again at the
    short interval; ``hurry`` (its stream ended) has it asked at once, then at the short interval."""
    workers = Workers(ready_after=4)
    poller = ResultsPoller(workers.rpc, interval_s=0.001, first_interval_s=0.001, first_window_s=5.0, gather_s=0.0,
                           patient_interval_s=60.0)
    collector = _collector("early")

    async def main():
        asking = asyncio.create_task(poller.collect(collector, patient=True))
        await asyncio.sleep(0.2)
        asked_before = len(workers.calls)
        poller.hurry(collector)
        await asking
        return asked_before

    started = time.monotonic()
    assert asyncio.run(main()) == 1  # one round, then the long interval
    assert workers.calls == [{"early"}] * 4 and time.monotonic() - started < 10


def test_patient_keys_ride_along_with_waiting_ones_and_alone_go_at_the_patient_interval():
    """A caller that waits, arriving while only patient keys are asked for, is asked for at once (not after the
    patient interval), and the patient keys go in its rounds; patient keys alone go at the patient interval."""
    workers = Workers(ready_after=3)
    poller = ResultsPoller(workers.rpc, interval_s=0.001, first_interval_s=0.001, first_window_s=0.0, gather_s=0.0,
                           patient_interval_s=0.5)
    early, waited = _collector("early"), _collector("waited")

    async def main():
        asking = asyncio.create_task(poller.collect(early, patient=True))
        await asyncio.sleep(0.05)  # the first round has gone: the poller waits at the patient interval
        started = time.monotonic()
        await poller.collect(waited)
        waited_took = time.monotonic() - started
        answered_with_it = not early.pending
        await asking
        started = time.monotonic()
        await poller.collect(_collector("later"), patient=True)  # alone: rounds at the patient interval
        return waited_took, answered_with_it, time.monotonic() - started

    waited_took, answered_with_it, later_took = asyncio.run(main())
    assert waited_took < 0.25 and answered_with_it and later_took >= 1.0
