"""Speculative decoding: steering runs with it (the verify steps steer draft tokens by position, as any other);
capture and patching, which would return rows of rejected drafts, are refused when the engine starts."""

import pytest
from vllm import SamplingParams

from tests.conftest import ENGINE_KWARGS, engine_in_this_process, shutdown, vector
from vllm_interp import LLM, steered_params

# Prompts that repeat themselves, so that n-gram lookup proposes drafts, some of which the model rejects.
PROMPTS = ["The cat sat on the mat. The dog sat on the rug. The bird sat on the",
           "one two three four one two three five one two three six one two"]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
ENGINE = {**ENGINE_KWARGS, "enforce_eager": True}


def _steered(max_tokens: int = 24) -> SamplingParams:
    # Decode-tier vectors alone: a verify step's rows are generated positions, which take them.
    return steered_params(SamplingParams(temperature=0.0, max_tokens=max_tokens),
                          decode_steering_vectors={"post_block": {"12": vector(4, norm=12.0)}})


def test_steering_under_speculative_decoding_generates_what_it_does_without(smollm2_path, smollm2_llm):
    unsteered = [o.outputs[0].token_ids for o in smollm2_llm.generate(
        PROMPTS, SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)]
    expected = [o.outputs[0].token_ids for o in smollm2_llm.generate(PROMPTS, _steered(), use_tqdm=False)]
    assert expected != unsteered  # the vectors change what is generated
    with engine_in_this_process():
        llm = LLM(str(smollm2_path), enable_steering=True, capture_consumers=(), speculative_config=NGRAM,
                  disable_log_stats=False, **ENGINE)
        try:
            got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, _steered(), use_tqdm=False)]
            counts = {m.name: m.value for m in llm.get_metrics()
                      if m.name in ("vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")}
        finally:
            shutdown(llm)
    assert got == expected
    # Drafts were verified, and some were rejected: both kinds of verify step ran under steering.
    drafted, accepted = counts["vllm:spec_decode_num_draft_tokens"], counts["vllm:spec_decode_num_accepted_tokens"]
    assert 0 < accepted < drafted


@pytest.mark.parametrize(("features", "enabled"), [({"capture_consumers": ("inline",)}, "inline"),
                                                 ({"capture_consumers": (), "enable_patching": True}, "patch_source")],
                         ids=["capture", "patching"])
def test_capture_and_patching_are_refused_with_speculative_decoding(smollm2_path, features, enabled):
    with engine_in_this_process(), pytest.raises(ValueError, match="do not run with speculative decoding") as refused:
        LLM(str(smollm2_path), speculative_config=NGRAM, **features, **ENGINE)
    assert f"enabled here: {enabled})" in str(refused.value)
