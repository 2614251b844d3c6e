"""Preemption: requests of every steering tier and a capturing request are preempted (the test checks which
ones were) and recomputed, and their outputs and rows still equal transformers'.

A recompute after preemption runs the prompt and the tokens generated so far as one long prefill: steering
must still pick each position's tier by whether it is in the prompt (not by the step's shape), and capture
must keep each position once.
"""

import os

import pytest

from tests.conftest import ENGINE_KWARGS, shutdown, vector
from tests.steering.common import as_steering, assert_matches_reference, greedy
from vllm_interp import steered_params

MAX_TOKENS = 96  # with the prompt, within one block
BLOCK = 128
HOG_TOKENS = 4 * BLOCK + 8  # a prompt that needs five KV blocks


def _record_preemptions(worker) -> None:
    """Runs in the worker (collective_rpc): note the prompt of every request the scheduler preempts."""
    runner = worker.model_runner
    seen = runner.__dict__.setdefault("test_preempted_prompts", [])
    update_states = runner._update_states

    def recording(scheduler_output, *args, **kwargs):
        for req_id in scheduler_output.preempted_req_ids or ():
            state = runner.requests.get(req_id)
            seen.append(tuple(state.prompt_token_ids) if state is not None else req_id)
        return update_states(scheduler_output, *args, **kwargs)

    runner._update_states = recording


def _preempted_prompts(worker) -> list[tuple[int, ...]]:
    return worker.model_runner.test_preempted_prompts


@pytest.fixture(scope="module")
def cramped_llm(smollm2_path):
    """Six 128-token KV blocks and priority scheduling: a five-block request preempts the others, lowest
    priority first. A long prompt takes at most 8 of a step's 16 tokens, so the others run beside it. The
    test sends functions to the worker (collective_rpc), which vLLM allows only with insecure serialization
    on."""
    from vllm_interp import LLM

    saved = os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    kwargs = dict(ENGINE_KWARGS, max_model_len=6 * BLOCK, kv_cache_memory_bytes=6 * BLOCK * 46080, enforce_eager=True,
                  scheduling_policy="priority", long_prefill_token_threshold=8)
    llm = LLM(str(smollm2_path), enable_steering=True, max_steering_configs=4, **kwargs)
    llm.collective_rpc(_record_preemptions)
    yield llm
    shutdown(llm)
    if saved is None:
        os.environ.pop("VLLM_ALLOW_INSECURE_SERIALIZATION")
    else:
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = saved


def test_preempted_requests_of_every_tier_and_a_capture_equal_transformers(
    cramped_llm, smollm2_reference, smollm2_tokenizer, prompt_ids
):
    tiers = {
        "base": {"pre_attn": {"14": vector(23)}},
        "prefill": {"post_block": {"4": vector(21)}},
        "decode": {"post_attn": {"9": vector(22)}},
    }
    field = {"base": "steering_vectors", "prefill": "prefill_steering_vectors", "decode": "decode_steering_vectors"}
    text = " ".join(f"Note {i}: the {['amber', 'teal', 'plum'][i % 3]} lamp is on." for i in range(80))
    hog = smollm2_tokenizer(text).input_ids[:HOG_TOKENS]
    # The hog (priority 0) runs throughout; as its prompt grows into blocks 2 to 5 the scheduler preempts the
    # running request of the highest priority value: capture, decode, prefill, base in turn. Each resumes
    # once the hog is done, recomputing its prompt and the tokens it had generated.
    names = ["hog", "base", "prefill", "decode", "capture"]
    prompts = [hog, *prompt_ids]
    params = [greedy(4), *(steered_params(greedy(MAX_TOKENS), **{field[t]: tiers[t]}) for t in tiers),
              greedy(MAX_TOKENS)]
    readout = [None] * 4 + [{"hooks": {"post_block": [5], "pre_attn": [0, 29]}, "positions": "all"}]
    outputs = cramped_llm.generate([{"prompt_token_ids": p} for p in prompts], params, readout=readout,
                                   priority=list(range(5)), use_tqdm=False)

    preempted = [names[prompts.index(list(p))] for worker in cramped_llm.collective_rpc(_preempted_prompts)
                 for p in worker]
    assert set(preempted) == {"base", "prefill", "decode", "capture"}, f"preempted: {preempted}"
    for name, output in zip(names, outputs, strict=True):
        steering = as_steering(name, tiers[name]) if name in tiers else {}
        assert_matches_reference(smollm2_reference, output, steering, name)
    # Every computed position exactly once (the last generated token is never fed back).
    capture = outputs[-1].residuals
    assert capture.positions == list(range(len(prompts[-1]) + MAX_TOKENS - 1))
