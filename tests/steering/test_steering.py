"""Steering on the real SmolLM2 engine: exact against transformers, isolated in mixed batches,
prefix-cache correct."""

import numpy as np
import pytest
from vllm import SamplingParams

from tests.steering.reference import hf_steered_logprobs, load_reference
from vllm_interp import steered_params
from vllm_interp.steering.vectors import SteeringError

HIDDEN = 576
MAX_TOKENS = 8
# vLLM and transformers agree to ~2e-5 in logprobs on the unsteered model (fp32); steering adds no error.
LOGPROB_TOL = 1e-4
PROMPT = "The capital of France is"


def _vector(seed: int, norm: float = 8.0) -> list[float]:
    v = np.random.default_rng(seed).standard_normal(HIDDEN).astype(np.float32)
    return (v / np.linalg.norm(v) * norm).tolist()


def _greedy(logprobs: int | None = 1) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=logprobs)


def _moved(a, b) -> float:
    """How far steering moved an output: a token change counts as 1, else the max logprob change."""
    return 1.0 if a[0] != b[0] else float(np.max(np.abs(np.asarray(a[1]) - np.asarray(b[1]))))


# The frontend submits a batch's requests one by one and the engine-core process may start stepping before
# the last arrives, so two runs of the same batch can differ in step composition and hence in kernel
# round-off (seen: 2e-7). Equal tokens and logprobs within this bound is "unchanged"; steering moves them
# by more than 1e-2.
ROUND_OFF = 1e-5


def _assert_same_output(a, b) -> None:
    assert a[0] == b[0], "greedy tokens differ"
    diff = max((abs(x - y) for x, y in zip(a[1], b[1], strict=True)), default=0.0)
    assert diff < ROUND_OFF, f"logprobs differ by {diff:.2e}"


def _tokens_and_logprobs(output):
    completion = output.outputs[0]
    tokens = list(completion.token_ids)
    return tokens, [completion.logprobs[i][t].logprob for i, t in enumerate(tokens)]


CASES = [(tier, hook) for tier in ("base", "prefill", "decode") for hook in ("pre_attn", "post_attn", "post_block")]
FIELD = {"base": "steering_vectors", "prefill": "prefill_steering_vectors", "decode": "decode_steering_vectors"}


def test_steered_logprobs_equal_transformers_for_every_tier_and_hook(smollm2_llm, smollm2_path, prompt_ids):
    prompt = prompt_ids[1]
    cases = {}
    for i, (tier, hook) in enumerate(CASES):
        spec = {hook: {"10": _vector(i), "20": {"vector": _vector(100 + i), "scale": 0.5}}}
        cases[(tier, hook)] = spec
    params = [steered_params(_greedy(), **{FIELD[tier]: spec}) for (tier, _), spec in cases.items()]
    # Nine configs, four table slots: requests wait for a slot (never run unsteered) and all match.
    outputs = smollm2_llm.generate([{"prompt_token_ids": prompt}] * len(params), params, use_tqdm=False)
    unsteered = _tokens_and_logprobs(smollm2_llm.generate([{"prompt_token_ids": prompt}], _greedy(),
                                                          use_tqdm=False)[0])
    reference = load_reference(smollm2_path)
    report = []
    for ((tier, hook), spec), output in zip(cases.items(), outputs, strict=True):
        tokens, logprobs = _tokens_and_logprobs(output)
        steering = {(tier, int(layer), hook): (entry["vector"] if isinstance(entry, dict) else entry) for layer, entry
                    in spec[hook].items()}
        steering = {k: np.asarray(v) * (0.5 if k[1] == 20 else 1.0) for k, v in steering.items()}
        ref_logprobs, ref_argmax = hf_steered_logprobs(reference, prompt, tokens, steering, len(prompt))
        diff = float(np.max(np.abs(np.asarray(logprobs) - ref_logprobs.numpy())))
        moved = _moved(unsteered, (tokens, logprobs))
        report.append((tier, hook, diff, moved))
        assert ref_argmax.tolist() == tokens, f"{tier}/{hook}: greedy tokens differ from transformers"
        assert diff <= LOGPROB_TOL, f"{tier}/{hook}: max logprob diff {diff:.2e}"
    print("\nsteered logprobs vs transformers (max abs diff; how far steering moved them from unsteered):")
    for tier, hook, diff, moved in report:
        print(f"  {tier:<8}{hook:<11}{diff:.2e}  {moved:.3f}")
    # Equality with transformers means something only if steering changed the output well beyond it.
    assert all(moved > 100 * LOGPROB_TOL for *_, moved in report)


def test_mixed_batch_leaves_unsteered_requests_unchanged(smollm2_llm, plain_llm, prompt_ids):
    prompts = [{"prompt_token_ids": prompt_ids[0]}, {"prompt_token_ids": prompt_ids[3]}]
    steered = steered_params(_greedy(), steering_vectors={"post_block": {"5": _vector(7)}})
    mixed = smollm2_llm.generate(prompts, [steered, _greedy()], use_tqdm=False)
    baseline = plain_llm.generate(prompts, _greedy(), use_tqdm=False)
    _assert_same_output(_tokens_and_logprobs(mixed[1]), _tokens_and_logprobs(baseline[1]))
    assert _moved(_tokens_and_logprobs(mixed[0]), _tokens_and_logprobs(baseline[0])) > 0.01


def test_global_steering_applies_to_all_and_clearing_restores_the_baseline(smollm2_llm, plain_llm, prompt_ids):
    prompts = [{"prompt_token_ids": p} for p in prompt_ids[:2]]
    baseline = [_tokens_and_logprobs(o) for o in smollm2_llm.generate(prompts, _greedy(), use_tqdm=False)]
    plain = [_tokens_and_logprobs(o) for o in plain_llm.generate(prompts, _greedy(), use_tqdm=False)]
    for ours, theirs in zip(baseline, plain, strict=True):
        _assert_same_output(ours, theirs)
    try:
        state = smollm2_llm.set_steering(vectors={"post_attn": {"12": _vector(3)}})
        assert list(state["vectors"]["post_attn"]) == ["12"]
        steered = [_tokens_and_logprobs(o) for o in smollm2_llm.generate(prompts, _greedy(), use_tqdm=False)]
        assert all(_moved(s, b) > 0.01 for s, b in zip(steered, baseline, strict=True))
    finally:
        smollm2_llm.clear_steering()
    after = [_tokens_and_logprobs(o) for o in smollm2_llm.generate(prompts, _greedy(), use_tqdm=False)]
    for cleared, before in zip(after, baseline, strict=True):
        _assert_same_output(cleared, before)


def test_named_vectors_steer_like_inline_ones(smollm2_llm, prompt_ids):
    prompt = [{"prompt_token_ids": prompt_ids[2]}]
    spec = {"pre_attn": {"8": _vector(11)}}
    smollm2_llm.register_steering_vectors("formal", vectors=spec)
    try:
        assert smollm2_llm.list_steering_vectors() == ["formal"]
        named = smollm2_llm.generate(prompt, steered_params(_greedy(), steering_name="formal"), use_tqdm=False)
        inline = smollm2_llm.generate(prompt, steered_params(_greedy(), steering_vectors=spec), use_tqdm=False)
        assert _tokens_and_logprobs(named[0]) == _tokens_and_logprobs(inline[0])
    finally:
        smollm2_llm.unregister_steering_vectors("formal")


def test_prefix_cache_never_serves_steered_kv_and_shares_what_it_may(smollm2_llm, plain_llm, smollm2_tokenizer):
    # Three full 128-token blocks: long enough for the CPU engine's prefix cache.
    text = " ".join(f"Item {i} of the inventory is a {['red', 'green', 'blue'][i % 3]} box." for i in range(40))
    prompt = [{"prompt_token_ids": smollm2_tokenizer(text).input_ids[:400]}]
    fresh = plain_llm.generate(prompt, _greedy(), use_tqdm=False)[0]

    prefill = steered_params(_greedy(), prefill_steering_vectors={"post_block": {"3": _vector(5)}})
    smollm2_llm.generate(prompt, prefill, use_tqdm=False)
    after_prefill = smollm2_llm.generate(prompt, _greedy(), use_tqdm=False)[0]
    assert after_prefill.num_cached_tokens == 0, "unsteered request reused KV computed under prefill steering"
    assert _tokens_and_logprobs(after_prefill) == _tokens_and_logprobs(fresh)

    decode = steered_params(_greedy(), decode_steering_vectors={"post_block": {"3": _vector(6)}})
    decoded = smollm2_llm.generate(prompt, decode, use_tqdm=False)[0]
    # Decode-only steering does not fork the prompt's blocks: it reuses the unsteered run's cache.
    assert decoded.num_cached_tokens >= 384


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
        smollm2_llm.generate([PROMPT], steered_params(_greedy(), **fields), use_tqdm=False)
