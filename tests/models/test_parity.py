"""Every layer x hook x position read by vllm-interp equals the residual stream transformers computes."""

import pytest

from tests.conftest import ENGINE_KWARGS, shutdown
from tests.parity import compare, engine_sequences_and_readouts, hf_residuals
from tests.zoo import ARCHS, _input_of, build_checkpoint

MAX_TOKENS = 6


def test_smollm2_parity(smollm2_llm, smollm2_path, prompt_ids, parity_table):
    # Prompts of 5 to 30 tokens with 16-token steps: prefill is chunked and mixed with decode steps.
    assert max(map(len, prompt_ids)) > ENGINE_KWARGS["max_num_batched_tokens"]
    sequences, readouts = engine_sequences_and_readouts(smollm2_llm, prompt_ids, MAX_TOKENS)
    references = hf_residuals(smollm2_path, sequences, _input_of("post_attention_layernorm"))
    result = compare(readouts, references, num_layers=30)
    parity_table.append(("smollm2 (real, compiled)", result))


@pytest.mark.parametrize("arch", ARCHS, ids=[a.name for a in ARCHS])
def test_random_weight_parity(arch, tmp_path_factory, prompt_ids, parity_table):
    from vllm_interp import LLM

    path = build_checkpoint(arch, tmp_path_factory.getbasetemp() / "zoo")
    llm = LLM(str(path), model_impl=arch.model_impl, enforce_eager=not arch.compiled, **ENGINE_KWARGS)
    try:
        sequences, readouts = engine_sequences_and_readouts(llm, prompt_ids, MAX_TOKENS)
        num_layers = llm.num_layers
    finally:
        shutdown(llm)
    references = hf_residuals(path, sequences, arch.post_attn)
    result = compare(readouts, references, num_layers=num_layers)
    parity_table.append((f"{arch.name} ({'compiled' if arch.compiled else 'eager'})", result))
