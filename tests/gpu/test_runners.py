"""vLLM's two model runners hooked alike on the GPU: V2 (vLLM's pick for this model) and V1 steer the same, and
on both a capturing step reads its rows inside the replayed CUDA graph within the graph row budget and runs
eagerly beyond it (rows and patch grids are compared with eager's in test_capture.py and test_patching.py)."""

import pytest

from tests.gpu.modes import print_figure
from tests.gpu.test_steering import LOGPROB_TOL

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(("v2", "v1"), [("eager", "v1_eager"), ("graphs", "v1_graphs")])
def test_the_runners_steer_alike(engines, v2, v1):
    results = engines.alongside(v2, v1)
    got, want = results[v2]["steering"], results[v1]["steering"]
    assert sorted(got) == sorted(want)
    diffs = {case: max(abs(x - y) for x, y in zip(got[case], want[case], strict=True)) for case in want}
    print_figure(f"steering {v2} (V2) vs {v1}", "max logprob diff per case: "
                 + ", ".join(f"{case} {diff:.2e}" for case, diff in diffs.items()))
    assert max(diffs.values()) <= LOGPROB_TOL, diffs


@pytest.mark.parametrize("mode", ["graphs", "v1_graphs", "eager", "v1_eager"])
def test_capturing_steps_replay_graphs_within_the_row_budget(engines, mode):
    (steps,) = engines.alongside(mode)[mode]["capture_steps"]  # one worker
    print_figure(f"capturing steps ({mode})", f"{steps['graph']} read inside replayed graphs, {steps['eager']} "
                                              f"ran eagerly; {steps['replayed']} of all {steps['steps']} steps "
                                              "replayed a graph")
    if mode.endswith("eager"):
        assert steps["graph"] == 0 and steps["eager"] > 0 and steps["replayed"] == 0
    else:
        # Decode steps read one row per request (at most 8) inside their graphs; 16-token prefill chunks read
        # 16 rows, past the modes' budget of 8, and run eagerly.
        assert steps["graph"] > 0 and steps["eager"] > 0
        assert steps["graph"] <= steps["replayed"] < steps["steps"]
