"""Prefix caching under steering, in every direction: block hashes fork exactly where activations differ.

Each test uses its own 400-token prompt (three full 128-token blocks, what the CPU engine caches), runs one
request to fill the cache and a second that must either reuse it (``num_cached_tokens >= 384``) or not
(``0``), and grades the second against transformers steered the same way, so reused KV computed under other
vectors shows as a wrong output as well as a wrong count.
"""

import pytest

from tests.conftest import vector
from tests.steering.common import (
    as_steering,
    assert_matches_reference,
    assert_same_output,
    greedy,
    tokens_and_logprobs,
)
from vllm_interp import steered_params

SHARED_BLOCKS = 384  # the prompt's three full blocks
FIELD = {"base": "steering_vectors", "prefill": "prefill_steering_vectors", "decode": "decode_steering_vectors"}


@pytest.fixture
def long_prompt(smollm2_tokenizer, request):
    """400 tokens no other test sends (the test's name picks the words), so no earlier test cached them."""
    words = request.node.name.split("_")
    text = " ".join(f"Entry {i}: the {words[i % len(words)]} shelf holds item {i * 7}." for i in range(60))
    ids = smollm2_tokenizer(text).input_ids[:400]
    assert len(ids) == 400
    return [{"prompt_token_ids": ids}]


def _run(llm, prompt, tier: str | None = None, spec: dict | None = None):
    params = greedy() if tier is None else steered_params(greedy(), **{FIELD[tier]: spec})
    return llm.generate(prompt, params, use_tqdm=False)[0]


def test_steered_request_after_unsteered_never_reuses_its_kv(smollm2_llm, smollm2_reference, long_prompt):
    assert _run(smollm2_llm, long_prompt).num_cached_tokens == 0
    for tier, seed in (("base", 1), ("prefill", 2)):
        spec = {"post_block": {"3": vector(seed)}}
        steered = _run(smollm2_llm, long_prompt, tier, spec)
        # Base and prefill vectors steer position 0 on: no block of the unsteered run may be reused.
        assert steered.num_cached_tokens == 0, f"{tier} steering reused unsteered KV"
        assert_matches_reference(smollm2_reference, steered, as_steering(tier, spec), tier)
    # Decode vectors steer only generated tokens: the prompt's blocks are the unsteered ones.
    spec = {"post_block": {"3": vector(3)}}
    decode = _run(smollm2_llm, long_prompt, "decode", spec)
    assert decode.num_cached_tokens >= SHARED_BLOCKS
    assert_matches_reference(smollm2_reference, decode, as_steering("decode", spec), "decode")


def test_unsteered_request_after_steered_never_reuses_its_kv(smollm2_llm, plain_llm, long_prompt):
    fresh = plain_llm.generate(long_prompt, greedy(), use_tqdm=False)[0]
    _run(smollm2_llm, long_prompt, "prefill", {"post_block": {"3": vector(5)}})
    after = _run(smollm2_llm, long_prompt)
    assert after.num_cached_tokens == 0, "unsteered request reused KV computed under prefill steering"
    assert tokens_and_logprobs(after) == tokens_and_logprobs(fresh)


@pytest.mark.parametrize("tier", ["base", "prefill"])
def test_other_values_at_the_same_sites_never_share(smollm2_llm, smollm2_reference, long_prompt, tier):
    _run(smollm2_llm, long_prompt, tier, {"pre_attn": {"7": vector(10)}})
    spec = {"pre_attn": {"7": vector(11)}}
    second = _run(smollm2_llm, long_prompt, tier, spec)
    assert second.num_cached_tokens == 0, "reused KV computed under other vectors at the same site"
    assert_matches_reference(smollm2_reference, second, as_steering(tier, spec), tier)


def test_identical_specs_share_every_full_block(smollm2_llm, long_prompt):
    spec = {"post_attn": {"9": vector(20)}}
    first = _run(smollm2_llm, long_prompt, "prefill", spec)
    again = _run(smollm2_llm, long_prompt, "prefill", spec)
    assert first.num_cached_tokens == 0 and again.num_cached_tokens >= SHARED_BLOCKS
    assert_same_output(tokens_and_logprobs(again), tokens_and_logprobs(first))


def test_decode_only_specs_share_the_prompt_blocks_whatever_their_values(
    smollm2_llm, smollm2_reference, long_prompt
):
    _run(smollm2_llm, long_prompt, "decode", {"post_block": {"3": vector(30)}})
    spec = {"post_block": {"3": vector(31)}}
    second = _run(smollm2_llm, long_prompt, "decode", spec)
    assert second.num_cached_tokens >= SHARED_BLOCKS
    assert_matches_reference(smollm2_reference, second, as_steering("decode", spec), "decode")


def test_global_changes_fork_the_cache(smollm2_llm, plain_llm, smollm2_reference, long_prompt):
    fresh = plain_llm.generate(long_prompt, greedy(), use_tqdm=False)[0]
    first, second = {"post_block": {"2": vector(40)}}, {"post_block": {"2": vector(41)}}
    try:
        smollm2_llm.set_steering(prefill_vectors=first)
        assert _run(smollm2_llm, long_prompt).num_cached_tokens == 0
        smollm2_llm.set_steering(prefill_vectors=second)
        changed = _run(smollm2_llm, long_prompt)
        assert changed.num_cached_tokens == 0, "reused KV computed under the previous global vectors"
        assert_matches_reference(smollm2_reference, changed, as_steering("prefill", second), "global")
    finally:
        smollm2_llm.clear_steering()
    cleared = _run(smollm2_llm, long_prompt)
    assert cleared.num_cached_tokens == 0, "reused KV computed under the cleared global vectors"
    assert tokens_and_logprobs(cleared) == tokens_and_logprobs(fresh)
