"""The seam's start-up checks: every touchpoint of the vLLM 0.26 adapter holds on the installed vLLM, and a
missing or reshaped internal stops start-up with a message naming it and why vllm-interp needs it."""

import argparse

import pytest
from vllm.v1.core import kv_cache_utils
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from vllm_interp.engine.touchpoints import Touchpoint, VllmInternalsMismatch, check_attributes, check_touchpoints
from vllm_interp.engine.v0_26 import all_touchpoints, prefix_cache_keys, runner_v1, runner_v2, serve
from vllm_interp.engine.v0_26.runner import hooks_for
from vllm_interp.engine.versions import adapter


def test_every_touchpoint_holds_on_the_installed_vllm():
    touchpoints = all_touchpoints()
    assert {t.use for t in touchpoints} == {"override", "call", "patch", "read", "env"}
    check_touchpoints(touchpoints)
    assert adapter().__name__ == "vllm_interp.engine.v0_26"


def test_a_missing_method_is_named_with_the_reason(monkeypatch):
    monkeypatch.delattr(GPUModelRunner, "_model_forward")
    with pytest.raises(VllmInternalsMismatch) as caught:
        check_touchpoints(runner_v1.TOUCHPOINTS)
    message = str(caught.value)
    assert "vllm.v1.worker.gpu_model_runner:GPUModelRunner._model_forward: missing" in message
    assert "vllm-interp overrides it: the plan is published to the site op around the forward" in message


def test_the_v2_runner_is_checked_too(monkeypatch):
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2Runner

    monkeypatch.setattr(V2Runner, "execute_model", lambda self, scheduler_output: None)
    with pytest.raises(VllmInternalsMismatch) as caught:
        check_touchpoints(runner_v2.TOUCHPOINTS)
    message = str(caught.value)
    assert ("vllm.v1.worker.gpu.model_runner:GPUModelRunner.execute_model: no parameter intermediate_tensors, "
            "dummy_run, skip_attn_for_dummy_run, is_profile") in message


def test_a_runner_neither_mixin_hooks_is_named():
    class TPUModelRunner:
        pass

    with pytest.raises(RuntimeError, match=r"hooks vLLM's V1 and V2 model runners; this worker runs "
                                           r"tests\.engine\.test_touchpoints\.TPUModelRunner"):
        hooks_for(TPUModelRunner())


def test_a_reshaped_function_is_named_with_the_parameter(monkeypatch):
    monkeypatch.setattr(kv_cache_utils, "generate_block_hash_extra_keys", lambda request, start, end: (None, 0))
    with pytest.raises(VllmInternalsMismatch,
                       match=r"generate_block_hash_extra_keys: no parameter start_token_idx, end_token_idx, "
                             r"start_mm_idx \(vllm-interp patches it"):
        check_touchpoints(prefix_cache_keys.TOUCHPOINTS)


def test_every_problem_is_listed_at_once():
    touchpoints = [Touchpoint("vllm.no_such_module:X", "call", "one"),
                   Touchpoint("env:VLLM_NO_SUCH_FLAG", "env", "two")]
    with pytest.raises(VllmInternalsMismatch) as caught:
        check_touchpoints(touchpoints)
    assert "vllm.no_such_module:X: missing" in str(caught.value)
    assert "env:VLLM_NO_SUCH_FLAG: missing (vllm.envs does not know VLLM_NO_SUCH_FLAG)" in str(caught.value)


def test_live_state_is_checked_by_attribute_path():
    class Batch:
        req_ids = []

    class Runner:
        input_batch = Batch()

    with pytest.raises(VllmInternalsMismatch) as caught:
        check_attributes(Runner(), "GPUModelRunner", runner_v1.ATTRIBUTES)
    message = str(caught.value)
    assert "GPUModelRunner.input_batch.num_computed_tokens_cpu: missing on Runner" in message
    assert "GPUModelRunner.query_start_loc.np: missing" in message
    assert "GPUModelRunner.input_batch.req_ids" not in message


def test_the_engine_count_refuses_flags_it_does_not_know():
    with pytest.raises(VllmInternalsMismatch, match="no longer has --headless"):
        serve.engine_count(argparse.Namespace(data_parallel_size=1))
