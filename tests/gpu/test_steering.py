"""Steering under CUDA graphs, on one GPU and across two with tensor parallelism: graph replays steer as eager
steps do, for every tier, a mixed batch, global vectors and their clearing."""

import pytest

from tests.gpu.engine_run import MULTIPROCESS_MODES, STEERED_MODES
from tests.gpu.modes import print_figure, with_eager

pytestmark = pytest.mark.gpu

# Same fp32 model up to Inductor's fusions: gpu-tests-2026-11-26.md saw sampled-token logprobs differ by at
# most 3.4e-5 between graphs and eager, while the vectors moved them by 0.34-0.60. 1e-3 sits 30x above the one
# and 300x below the other; a replay that drops or doubles a vector is off by the whole effect. TP2 with graphs
# adds the all-reduce's order, which moved patched logprobs by 4.4e-5 (eager TP2): the same bound holds it.
LOGPROB_TOL = 1e-3
# Graph modes held to one eager GPU (graphs_mp is held to graphs in test_multiprocessing.py).
GRAPH_MODES = ["graphs", "tp2_graphs"]


def _max_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def _steering(engines, mode: str) -> dict[str, dict[str, list[float]]]:
    return {m: result["steering"] for m, result in with_eager(engines, mode).items() if m in STEERED_MODES}


@pytest.mark.parametrize("case", ["unsteered", "base", "prefill", "decode", "global"])
@pytest.mark.parametrize("mode", GRAPH_MODES)
def test_graphs_steer_as_eager_steps_do(engines, mode, case):
    steering = _steering(engines, mode)
    diff = _max_diff(steering[mode][case], steering["eager"][case])
    moved = _max_diff(steering["eager"][case], steering["eager"]["unsteered"])
    label = f"steering {case}" if mode == "graphs" else f"steering {case} ({mode})"
    print_figure(label, f"max logprob diff {mode} vs eager {diff:.2e}; steering moved it by {moved:.3f}")
    assert diff <= LOGPROB_TOL
    if case != "unsteered":
        # Otherwise the comparison above would prove nothing about steering.
        assert moved > 10 * LOGPROB_TOL


@pytest.mark.parametrize("mode", STEERED_MODES)
def test_unsteered_request_in_a_steered_batch_is_untouched(engines, mode):
    steering = _steering(engines, mode)[mode]
    if mode not in MULTIPROCESS_MODES:
        # Same step composition as the all-unsteered batch, and the zero row added: bit for bit the same.
        assert steering["mixed_unsteered"] == steering["pair_unsteered"]
        return
    # With the engine core in its own process, the frontend sends requests one by one and the engine core
    # steps as soon as one has arrived, so the same two requests may be split into other steps (other
    # rounding). The first device run measured 1.6e-5 here, while a leaked vector moves it by 0.34-0.60.
    diff = _max_diff(steering["mixed_unsteered"], steering["pair_unsteered"])
    print_figure(f"steering mixed batch ({mode})", f"max logprob diff unsteered row vs all-unsteered batch {diff:.2e}")
    assert diff <= LOGPROB_TOL


@pytest.mark.parametrize("mode", STEERED_MODES)
def test_clearing_global_steering_restores_the_unsteered_logprobs(engines, mode):
    # Not bit for bit: the second run reads its prompt's first blocks from the prefix cache.
    steering = _steering(engines, mode)[mode]
    diff = _max_diff(steering["after_clear"], steering["unsteered"])
    print_figure(f"steering after clear ({mode})", f"max logprob diff vs unsteered {diff:.2e}")
    assert diff <= LOGPROB_TOL
