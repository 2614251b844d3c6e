"""The offline engine with vLLM's default multiprocessing (the engine core in a process of its own) on the GPU:
it starts (again and again: an engine core in its own process once hung at start-up on the device), and
captures and steers under CUDA graphs as the in-process engine does."""

import pytest

from tests.gpu.engine_run import LAYERS, MP_STARTS, prompts
from tests.gpu.modes import print_figure, readouts, report, with_eager
from tests.gpu.test_capture import SAME_MODEL_REL_TOL
from tests.gpu.test_steering import LOGPROB_TOL
from tests.parity import compare

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def results(engines) -> dict[str, dict]:
    return with_eager(engines, "graphs_mp")


def test_engine_core_runs_in_its_own_process_and_starts_again(results):
    mp, inproc = results["graphs_mp"], results["graphs"]
    starts = mp["starts"]
    print_figure("graphs_mp engine starts", "; ".join(
        f"{s['init_s']:.1f} s ({s['method']}, CUDA initialized before {s['cuda_initialized']}, "
        f"{len(s['threads'])} threads before)" for s in starts))
    # Otherwise this mode would be a second in-process graphs run.
    assert [s["engine_core"] for s in starts] == ["SyncMPClient"] * MP_STARTS
    assert inproc["starts"][0]["engine_core"] == "InprocClient"
    # Each later engine generates as the first did (its sequence holds every generated token but the last).
    first = mp["parity"]["sequences"][0]
    for tokens in mp["restart_tokens"]:
        assert prompts(1)[0] + tokens[:-1] == first


def test_rows_match_the_in_process_engine(results):
    got, want = results["graphs_mp"]["parity"], results["graphs"]["parity"]
    assert got["sequences"] == want["sequences"]
    references = [r["tensors"] for r in want["readouts"]]
    report("graphs_mp vs graphs", compare(readouts(got), references, LAYERS, rel_tol=SAME_MODEL_REL_TOL))


def test_steers_as_the_in_process_engine_does(results):
    got, want = results["graphs_mp"]["steering"], results["graphs"]["steering"]
    assert sorted(got) == sorted(want)
    diffs = {case: max(abs(x - y) for x, y in zip(got[case], want[case], strict=True)) for case in want}
    print_figure("steering graphs_mp vs graphs", "max logprob diff per case: "
                 + ", ".join(f"{case} {diff:.2e}" for case, diff in diffs.items()))
    assert max(diffs.values()) <= LOGPROB_TOL, diffs
