"""Property-based fuzzing of every vllm-interp field and endpoint on the session server (every feature on).

The strategies and the property live in tests/server/fuzzing.py: every answer is a 2xx for a valid request or
a 4xx whose JSON error names the offending field, never a 5xx or a hang, and an accepted field of ours shows its
effect. Each family runs a fixed number of derandomized hypothesis examples (the same cases on every run) and
collects every failure before asserting, so one run lists all the bugs it met rather than the first one. The
smallest reproducers of the bugs fuzzing found run through the same property, and a background stream of fixed
greedy requests (plain, steered, capturing) runs throughout and must keep its output. benchmarks/fuzz.py runs
the same strategies for 10,000+ cases.
"""

from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.server import fuzzing

# The session server's consumers (patch_source comes with --enable-patching); logging is a built-in it does
# not enable, so naming it must be refused.
CONSUMERS = ("inline", "filesystem", "activation_stats", "sae_features", "patch_source")
DISABLED = ("logging",)

# Examples per family: 530 cases after the server's start. Generation takes the time: 300 of its cases took 175 s
# of a 2-core CI run (session 40), the routes' families 54 s each or less. The fuller fuzz is benchmarks/fuzz.py.
EXAMPLES = {"generation": 200, "steering_routes": 150, "patch_routes": 100, "raw_bodies": 80}


@pytest.fixture(scope="module")
def fuzzed(server) -> Iterator[tuple[fuzzing.Fuzzer, fuzzing.BackgroundStream]]:
    """A fuzzer on the session server, with the source run cases name and the background stream running;
    afterwards the named vectors and source runs fuzzing added are removed and global steering cleared (later
    tests expect the server as they found it)."""
    url, _ = server
    fuzzer = fuzzing.Fuzzer(url)
    snapshot = fuzzer.snapshot()
    fuzzer.prepare()
    background = fuzzing.BackgroundStream(url)
    background.start()
    try:
        yield fuzzer, background
    finally:
        background.stop()
        if fuzzer.alive():
            fuzzer.restore(snapshot)


def _run(fuzzer: fuzzing.Fuzzer, strategy: st.SearchStrategy[fuzzing.Case], examples: int) -> list[fuzzing.Failure]:
    found: list[fuzzing.Failure] = []

    # Generation only: nothing raises per case (failures are collected), so there is nothing to shrink.
    @settings(max_examples=examples, derandomize=True, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def one(case: fuzzing.Case) -> None:
        found.extend(fuzzer.run(case))

    one()
    return found


@pytest.mark.parametrize("family", EXAMPLES)
def test_every_answer_holds_the_property(fuzzed, family):
    strategy = fuzzing.families(CONSUMERS, DISABLED)[family]
    failures = _run(fuzzed[0], strategy, EXAMPLES[family])
    assert not failures, fuzzing.summarize(failures)


@pytest.mark.parametrize("name", fuzzing.REPRODUCERS)
def test_the_reproducers_of_bugs_fuzzing_found_hold_the_property(fuzzed, name):
    """The smallest bodies of the bugs fuzzing found (benchmarks/results/fuzz-cpu-2026-11-26.md), so that each
    fix is checked whatever the random cases meet."""
    failures = fuzzed[0].run(fuzzing.REPRODUCERS[name])
    assert not failures, fuzzing.summarize(failures)


def test_the_background_stream_kept_its_output(fuzzed):
    result = fuzzed[1].stop()
    assert result.ok, str(result)
