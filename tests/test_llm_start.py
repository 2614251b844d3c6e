"""Start-up refusals of vllm_interp.LLM: they happen before any engine process starts."""

import pytest
import transformers

from vllm_interp.models.registry import UnsupportedArchitecture


def test_unsupported_architecture_is_refused_with_the_supported_list(tmp_path):
    from vllm_interp import LLM

    config = transformers.BloomConfig(hidden_size=64, n_layer=2, n_head=4, vocab_size=128)
    transformers.BloomForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedArchitecture, match="'BloomForCausalLM'.*Supported: .*Qwen2ForCausalLM"):
        LLM(str(tmp_path))


def test_readout_needs_the_feature(smollm2_path):
    from vllm_interp.config import InterpConfig
    from vllm_interp.engine.args import interp_engine_args

    # With every feature off the engine is plain vLLM: no worker class, no additional_config entry.
    assert interp_engine_args(InterpConfig(), worker_cls="auto", additional_config=None) == ("auto", None)
    with pytest.raises(ValueError, match="own worker class"):
        interp_engine_args(InterpConfig(capture_consumers=("inline",)), worker_cls="my.Worker", additional_config=None)
