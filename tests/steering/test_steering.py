"""Steering on the real SmolLM2 engine: exact against transformers, isolated in mixed batches,
prefix-cache correct."""

import pytest

from tests.conftest import vector
from tests.steering.common import (
    LOGPROB_TOL,
    MAX_TOKENS,
    as_steering,
    assert_matches_reference,
    assert_same_output,
    greedy,
    moved,
    tokens_and_logprobs,
)
from vllm_interp import steered_params
from vllm_interp.steering.vectors import SteeringError

HIDDEN = 576
PROMPT = "The capital of France is"


CASES = [(tier, hook) for tier in ("base", "prefill", "decode") for hook in ("pre_attn", "post_attn", "post_block")]
FIELD = {"base": "steering_vectors", "prefill": "prefill_steering_vectors", "decode": "decode_steering_vectors"}


def test_steered_logprobs_equal_transformers_for_every_tier_and_hook(smollm2_llm, smollm2_reference, prompt_ids):
    prompt = prompt_ids[1]
    cases = {}
    for i, (tier, hook) in enumerate(CASES):
        cases[(tier, hook)] = {hook: {"10": vector(i), "20": {"vector": vector(100 + i), "scale": 0.5}}}
    params = [steered_params(greedy(), **{FIELD[tier]: spec}) for (tier, _), spec in cases.items()]
    # Nine configs, four table slots: requests wait for a slot (never run unsteered) and all match.
    outputs = smollm2_llm.generate([{"prompt_token_ids": prompt}] * len(params), params, use_tqdm=False)
    unsteered = tokens_and_logprobs(smollm2_llm.generate([{"prompt_token_ids": prompt}], greedy(),
                                                         use_tqdm=False)[0])
    report = []
    for ((tier, hook), spec), output in zip(cases.items(), outputs, strict=True):
        diff = assert_matches_reference(smollm2_reference, output, as_steering(tier, spec), f"{tier}/{hook}")
        report.append((tier, hook, diff, moved(unsteered, tokens_and_logprobs(output))))
    print("\nsteered logprobs vs transformers (max abs diff; how far steering moved them from unsteered):")
    for tier, hook, diff, how_far in report:
        print(f"  {tier:<8}{hook:<11}{diff:.2e}  {how_far:.3f}")
    # Equality with transformers means something only if steering changed the output well beyond it.
    assert all(how_far > 100 * LOGPROB_TOL for *_, how_far in report)


def test_global_and_request_vectors_add_up_and_capture_reads_the_steered_stream(
    smollm2_llm, smollm2_reference, prompt_ids
):
    # Global base and decode vectors; the request adds prefill vectors, one at a site the global base tier
    # also steers (they sum), and reads the steered sites at every position (prompt chunked: 30 tokens).
    global_base, global_decode = {"post_attn": {"12": vector(3)}}, {"pre_attn": {"5": vector(4)}}
    own = {"post_attn": {"12": vector(5)}, "post_block": {"20": vector(6)}}
    # pre_attn 21 is the point post_block 20 reads (read once in eager steps); pre_attn 5, steered in decode
    # steps, is not the point post_block 4 reads.
    readout = {"hooks": {"pre_attn": [5, 21], "post_attn": [12], "post_block": [4, 20, 21]}, "positions": "all"}
    prompts = [{"prompt_token_ids": prompt_ids[3]}, {"prompt_token_ids": prompt_ids[0]}]
    params = [steered_params(greedy(), prefill_steering_vectors=own), greedy()]
    plain = smollm2_llm.generate(prompts, params[1], use_tqdm=False)
    try:
        smollm2_llm.set_steering(vectors=global_base, decode_vectors=global_decode)
        outputs = smollm2_llm.generate(prompts, params, readout=readout, use_tqdm=False)
    finally:
        smollm2_llm.clear_steering()
    global_steering = {**as_steering("base", global_base), **as_steering("decode", global_decode)}
    expected = [{**global_steering, **as_steering("prefill", own)}, global_steering]
    for output, steering, before in zip(outputs, expected, plain, strict=True):
        assert output.residuals.positions == list(range(len(output.prompt_token_ids) + MAX_TOKENS - 1))
        assert_matches_reference(smollm2_reference, output, steering, "global + request")
        assert moved(tokens_and_logprobs(before), tokens_and_logprobs(output)) > 100 * LOGPROB_TOL


def test_mixed_batch_leaves_unsteered_requests_unchanged(smollm2_llm, plain_llm, prompt_ids):
    prompts = [{"prompt_token_ids": prompt_ids[0]}, {"prompt_token_ids": prompt_ids[3]}]
    steered = steered_params(greedy(), steering_vectors={"post_block": {"5": vector(7)}})
    mixed = smollm2_llm.generate(prompts, [steered, greedy()], use_tqdm=False)
    baseline = plain_llm.generate(prompts, greedy(), use_tqdm=False)
    assert_same_output(tokens_and_logprobs(mixed[1]), tokens_and_logprobs(baseline[1]))
    assert moved(tokens_and_logprobs(mixed[0]), tokens_and_logprobs(baseline[0])) > 0.01


def test_global_steering_applies_to_all_and_clearing_restores_the_baseline(smollm2_llm, plain_llm, prompt_ids):
    prompts = [{"prompt_token_ids": p} for p in prompt_ids[:2]]
    baseline = [tokens_and_logprobs(o) for o in smollm2_llm.generate(prompts, greedy(), use_tqdm=False)]
    plain = [tokens_and_logprobs(o) for o in plain_llm.generate(prompts, greedy(), use_tqdm=False)]
    for ours, theirs in zip(baseline, plain, strict=True):
        assert_same_output(ours, theirs)
    try:
        state = smollm2_llm.set_steering(vectors={"post_attn": {"12": vector(3)}})
        assert list(state["vectors"]["post_attn"]) == ["12"]
        steered = [tokens_and_logprobs(o) for o in smollm2_llm.generate(prompts, greedy(), use_tqdm=False)]
        assert all(moved(s, b) > 0.01 for s, b in zip(steered, baseline, strict=True))
    finally:
        smollm2_llm.clear_steering()
    after = [tokens_and_logprobs(o) for o in smollm2_llm.generate(prompts, greedy(), use_tqdm=False)]
    for cleared, before in zip(after, baseline, strict=True):
        assert_same_output(cleared, before)


def test_named_vectors_steer_like_inline_ones(smollm2_llm, prompt_ids):
    prompt = [{"prompt_token_ids": prompt_ids[2]}]
    spec = {"pre_attn": {"8": vector(11)}}
    smollm2_llm.register_steering_vectors("formal", vectors=spec)
    try:
        assert smollm2_llm.list_steering_vectors() == ["formal"]
        named = smollm2_llm.generate(prompt, steered_params(greedy(), steering_name="formal"), use_tqdm=False)
        inline = smollm2_llm.generate(prompt, steered_params(greedy(), steering_vectors=spec), use_tqdm=False)
        assert tokens_and_logprobs(named[0]) == tokens_and_logprobs(inline[0])
    finally:
        smollm2_llm.unregister_steering_vectors("formal")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"steering_vectors": {"post_block": {"3": [1.0, 2.0]}}}, r"steering_vectors\.post_block\.3: expected 576"),
        ({"steering_vectors": {"post_block": {"3": [float("nan")] * HIDDEN}}}, r"post_block\.3: values must be finite"),
        ({"prefill_steering_vectors": {"mlp_out": {"3": [0.0] * HIDDEN}}}, r"prefill_steering_vectors\.mlp_out"),
        ({"decode_steering_vectors": {"pre_attn": {"30": [0.0] * HIDDEN}}}, r"pre_attn\.30: layer out of range"),
        ({"steering_name": "nosuch"}, r"steering_name: unknown name 'nosuch'"),
        ({"steering_vectors": {"post_block": {"dtype": "float32", "shape": [1, HIDDEN], "layers": [3],
                                              "data": "%%%"}}}, r"post_block\.data: not valid base64"),
    ],
)
def test_bad_specs_are_refused_before_submission_naming_the_field(smollm2_llm, fields, message):
    with pytest.raises(SteeringError, match=message):
        smollm2_llm.generate([PROMPT], steered_params(greedy(), **fields), use_tqdm=False)
