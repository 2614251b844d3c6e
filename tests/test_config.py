"""Unit checks of the configuration and the start-up gates: InterpConfig, the vLLM version, architectures."""

import pytest

from vllm_interp.config import ADDITIONAL_CONFIG_KEY, SITE_SCHEME, InterpConfig, parse_consumer_spec
from vllm_interp.engine.versions import UnsupportedVllmVersion, check_vllm_version
from vllm_interp.models.registry import UnsupportedArchitecture, check_architecture


def test_config_round_trips_through_additional_config():
    config = InterpConfig(enable_steering=True, capture_consumers=("filesystem:root=/tmp/x",))
    additional = config.to_additional_config({"other": 1})
    assert additional["other"] == 1
    assert additional[ADDITIONAL_CONFIG_KEY]["site_scheme"] == SITE_SCHEME
    assert dict(additional)["other"] == 1
    assert InterpConfig.from_additional_config(additional) == config


def test_hash_changes_with_anything_that_shapes_the_graph():
    inline = ("inline",)
    base = InterpConfig(capture_consumers=inline)
    assert base.compute_hash() == InterpConfig(capture_consumers=inline).compute_hash()
    assert base.compute_hash() != InterpConfig(capture_consumers=inline, max_steering_configs=2).compute_hash()
    assert base.compute_hash() != InterpConfig(capture_consumers=inline, package_version="9.9").compute_hash()


def test_no_feature_means_no_hooks():
    assert not InterpConfig().hooks_needed
    assert InterpConfig(enable_patching=True).hooks_needed


def test_consumer_flag_syntax():
    assert parse_consumer_spec("filesystem:root=/data,layout=packed") == (
        "filesystem", {"root": "/data", "layout": "packed"},
    )
    with pytest.raises(ValueError, match="not 'key=val'"):
        InterpConfig(capture_consumers=("filesystem:root",))


def test_other_vllm_versions_are_refused_by_name():
    check_vllm_version("0.26.0+cpu")
    with pytest.raises(UnsupportedVllmVersion, match=r"supports vLLM 0\.26\.0 only, but vLLM 0\.27\.0"):
        check_vllm_version("0.27.0")


def test_unsupported_architecture_lists_the_supported_ones():
    check_architecture(["Olmo2ForCausalLM"])
    with pytest.raises(UnsupportedArchitecture, match="'BertForMaskedLM'.*Supported: .*LlamaForCausalLM"):
        check_architecture(["BertForMaskedLM"])


def test_transformers_backend_takes_causal_lm_decoders_only():
    # Any decoder through the backend: its layers are checked for a pre-MLP norm when the sites go in.
    check_architecture(["BloomForCausalLM"], model_impl="transformers")
    check_architecture(["OpenAIGPTLMHeadModel"], model_impl="transformers")
    for encoder_or_wrapper in ("BertForMaskedLM", "BertModel", "T5ForConditionalGeneration",
                               "Gemma3ForConditionalGeneration", "Qwen2ForSequenceClassification"):
        with pytest.raises(UnsupportedArchitecture, match=f"'{encoder_or_wrapper}'.*decoder-only causal LM"):
            check_architecture([encoder_or_wrapper], model_impl="transformers")


def test_http_payloads_are_parsed_once():
    from vllm_interp.request_args import interp_args

    extra = {"vllm_interp": '{"steering": {"digest": "d"}}', "other": 1}
    assert interp_args(extra) == {"steering": {"digest": "d"}}
    assert extra["vllm_interp"] == {"steering": {"digest": "d"}}  # the parsed form replaced the string
    assert interp_args(None) == {} and interp_args({"other": 1}) == {}


def test_vllm_compile_key_ignores_what_is_read_at_run_time():
    """vLLM's compile-cache key (VllmConfig.compute_hash) moves with the graph's shape only: consumer options,
    SAEs, the global capture and budgets reuse the compiled model; table heights and other user entries do not."""
    from vllm.config import VllmConfig

    def key(config: InterpConfig, other: dict | None = None) -> str:
        return VllmConfig(additional_config=config.to_additional_config(other)).compute_hash()

    base = InterpConfig(enable_steering=True, capture_consumers=("filesystem:root=/tmp/a",))
    runtime_only = InterpConfig(enable_steering=True, capture_consumers=("filesystem:root=/tmp/b", "inline"),
                                capture_overload_policy="drop", saes=("s=/tmp/sae",), patch_source_bytes=1 << 20,
                                capture_global='{"inline": {}}', engine_switch_interval_ms=0.5)
    assert key(base) == key(runtime_only)
    assert key(base) != key(InterpConfig(enable_steering=True, max_steering_configs=2,
                                         capture_consumers=("filesystem:root=/tmp/a",)))
    assert key(base) != key(InterpConfig(enable_patching=True, capture_consumers=("filesystem:root=/tmp/a",)))
    assert key(base) != key(base, {"other": 1})
    # The graph read buffers' height shapes the captured graphs; with no consumer there are none to size.
    assert key(base) != key(InterpConfig(enable_steering=True, max_graph_capture_rows=8,
                                         capture_consumers=("filesystem:root=/tmp/a",)))
    assert key(InterpConfig(enable_steering=True)) == key(InterpConfig(enable_steering=True, max_graph_capture_rows=8))
    assert key(InterpConfig(enable_steering=True)) != key(base)


def test_graph_read_buffers_hold_the_largest_graphs_tokens_unless_sized():
    # A step reads at most one row per token: by default no step vLLM would replay runs eagerly to capture.
    capturing = InterpConfig(capture_consumers=("inline",))
    assert capturing.graph_read_rows(512) == 512
    assert capturing.graph_read_rows(0) == 0  # no CUDA graphs (enforce_eager): no buffers
    assert InterpConfig(capture_consumers=("inline",), max_graph_capture_rows=8).graph_read_rows(512) == 8
    assert InterpConfig(capture_consumers=("inline",), max_graph_capture_rows=0).graph_read_rows(512) == 0
    assert InterpConfig(enable_steering=True).graph_read_rows(512) == 0  # nothing ever reads
    with pytest.raises(ValueError, match="max_graph_capture_rows"):
        InterpConfig(max_graph_capture_rows=-1)


def test_the_engine_switch_interval_is_set_in_the_workers_process_when_given():
    import sys

    from vllm_interp.engine.v0_26.worker import apply_switch_interval

    before = sys.getswitchinterval()
    try:
        apply_switch_interval(InterpConfig())
        assert sys.getswitchinterval() == before
        apply_switch_interval(InterpConfig(engine_switch_interval_ms=0.5))
        assert sys.getswitchinterval() == pytest.approx(0.0005)
    finally:
        sys.setswitchinterval(before)
    with pytest.raises(ValueError, match="engine_switch_interval_ms must be within 0-1000, got -1"):
        InterpConfig(engine_switch_interval_ms=-1)


def test_the_worker_reports_and_sets_the_switch_interval_at_run_time():
    import sys

    from vllm_interp.engine.v0_26.worker import InterpWorkerMixin

    before = sys.getswitchinterval()
    try:
        assert InterpWorkerMixin.interp_switch_interval(None) == pytest.approx(before * 1000)
        assert InterpWorkerMixin.interp_switch_interval(None, 0.5) == pytest.approx(0.5)
        assert sys.getswitchinterval() == pytest.approx(0.0005)
        with pytest.raises(ValueError, match=r"within \(0, 1000\] ms, got 0"):
            InterpWorkerMixin.interp_switch_interval(None, 0)
    finally:
        sys.setswitchinterval(before)
