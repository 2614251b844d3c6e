"""Preemption and global-steering cache keys: a preempted steered request resumes with the right tiers, its
read-out neither duplicates nor loses rows, and clearing global steering never lets a later request reuse
KV computed under the old vectors."""

import numpy as np
import pytest
from vllm import SamplingParams

from tests.conftest import ENGINE_KWARGS, shutdown
from tests.steering.test_steering import _greedy, _tokens_and_logprobs, _vector
from vllm_interp import steered_params

MAX_TOKENS = 120


@pytest.fixture(scope="module")
def cramped_llm(smollm2_path):
    """Room for only a few 128-token KV blocks: four growing requests must preempt each other."""
    from vllm_interp import LLM

    kwargs = dict(ENGINE_KWARGS, kv_cache_memory_bytes=5 * 128 * 46080, enforce_eager=True, disable_log_stats=False)
    llm = LLM(str(smollm2_path), enable_steering=True, max_steering_configs=4, **kwargs)
    yield llm
    shutdown(llm)


def _preemptions(llm) -> float:
    return sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")


def test_preempted_requests_keep_their_tiers_and_rows(cramped_llm, prompt_ids):
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    params = [
        steered_params(greedy, prefill_steering_vectors={"post_block": {"4": _vector(21)}}),
        steered_params(greedy, decode_steering_vectors={"post_attn": {"9": _vector(22)}}),
        steered_params(greedy, steering_vectors={"pre_attn": {"14": _vector(23)}}),
        greedy,
    ]
    prompts = [{"prompt_token_ids": p} for p in prompt_ids]
    readout = {"hooks": {"post_block": [5]}, "positions": "all"}
    before = _preemptions(cramped_llm)
    together = cramped_llm.generate(prompts, params, readout=readout, use_tqdm=False)
    assert _preemptions(cramped_llm) > before, "the KV cache was large enough: nothing was preempted"
    for prompt, param, out in zip(prompts, params, together, strict=True):
        alone = cramped_llm.generate([prompt], param, readout=readout, use_tqdm=False)[0]
        tokens, logprobs = _tokens_and_logprobs(out)
        alone_tokens, alone_logprobs = _tokens_and_logprobs(alone)
        assert tokens == alone_tokens
        assert np.max(np.abs(np.subtract(logprobs, alone_logprobs))) < 1e-4
        # Every computed position exactly once, recomputed rows equal to a run without preemption.
        expected = list(range(len(prompt["prompt_token_ids"]) + MAX_TOKENS - 1))
        assert out.residuals.positions == expected
        assert (out.residuals["5.post_block"] - alone.residuals["5.post_block"]).abs().max() < 1e-3


def test_clearing_global_steering_forks_the_prefix_cache(smollm2_llm, plain_llm, smollm2_tokenizer):
    text = " ".join(f"Entry {i}: the {['north', 'south', 'east'][i % 3]} gate opens at dawn." for i in range(40))
    prompt = [{"prompt_token_ids": smollm2_tokenizer(text).input_ids[:400]}]
    fresh = plain_llm.generate(prompt, _greedy(), use_tqdm=False)[0]
    try:
        smollm2_llm.set_steering(prefill_vectors={"post_block": {"2": _vector(31)}})
        smollm2_llm.generate(prompt, _greedy(), use_tqdm=False)
    finally:
        smollm2_llm.clear_steering()
    after = smollm2_llm.generate(prompt, _greedy(), use_tqdm=False)[0]
    assert after.num_cached_tokens == 0, "reused KV computed under the cleared global vectors"
    assert _tokens_and_logprobs(after) == _tokens_and_logprobs(fresh)
