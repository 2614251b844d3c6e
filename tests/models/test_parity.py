"""Every layer x hook x position read by vllm-interp equals the residual stream transformers computes; on one
architecture of each non-Llama hook form, steering at every hook equals transformers steered the same way."""

import json
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import pytest
from vllm import SamplingParams

from tests.conftest import ENGINE_KWARGS, engine_in_this_process, shutdown, vector
from tests.parity import compare, engine_sequences_and_readouts
from tests.reference import HookedReference, hf_residuals
from tests.steering.common import LOGPROB_TOL, assert_matches_reference, moved, tokens_and_logprobs
from tests.zoo import ARCHS, Arch, _input_of, build_checkpoint
from vllm_interp import steered_params
from vllm_interp.models.registry import TRANSFORMERS_BACKEND_ARCHITECTURES

MAX_TOKENS = 6


def test_smollm2_parity(smollm2_llm, smollm2_path, prompt_ids, parity_table):
    # Prompts of 5 to 30 tokens with 16-token steps: prefill is chunked and mixed with decode steps.
    assert max(map(len, prompt_ids)) > ENGINE_KWARGS["max_num_batched_tokens"]
    sequences, readouts = engine_sequences_and_readouts(smollm2_llm, prompt_ids, MAX_TOKENS)
    references = hf_residuals(smollm2_path, sequences, _input_of("post_attention_layernorm"))
    result = compare(readouts, references, num_layers=30)
    parity_table.append(("smollm2 (real, compiled)", result))


def _check_steering(llm, reference: HookedReference, prompt_ids) -> None:
    """Base vectors at every hook of layer 1 and prefill vectors at layer 2's post_attn, as one batch."""
    hidden = llm.llm_engine.model_config.get_hidden_size()
    base = {hook: {"1": vector(i, norm=2.0, size=hidden)} for i, hook in enumerate(("pre_attn", "post_attn",
                                                                                     "post_block"))}
    prefill = {"post_attn": {"2": vector(9, norm=2.0, size=hidden)}}
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    prompts = [{"prompt_token_ids": p} for p in prompt_ids[1:]]
    params = steered_params(greedy, steering_vectors=base, prefill_steering_vectors=prefill)
    plain = llm.generate(prompts, greedy, use_tqdm=False)
    steered = llm.generate(prompts, params, use_tqdm=False)
    steering = {("base", 1, hook): entry["1"] for hook, entry in base.items()} | {("prefill", 2, "post_attn"):
                                                                                  prefill["post_attn"]["2"]}
    for before, output in zip(plain, steered, strict=True):
        assert_matches_reference(reference, output, steering, "steered")
        assert moved(tokens_and_logprobs(before), tokens_and_logprobs(output)) > 100 * LOGPROB_TOL


def _engine_process(arch: Arch, path: Path) -> AbstractContextManager:
    """Where the architecture's engine runs: in this process (a start of seconds) unless vLLM serves it through
    its Transformers backend, which rewrites the transformers classes it loads (torch.compile decorators) in
    the process that loads them; the reference is built from those classes after the engine, so such an engine
    keeps its own process."""
    architectures = json.loads((path / "config.json").read_text())["architectures"]
    through_transformers = arch.model_impl == "transformers" or set(architectures) & set(
        TRANSFORMERS_BACKEND_ARCHITECTURES)
    return nullcontext() if through_transformers else engine_in_this_process()


@pytest.mark.parametrize("arch", ARCHS, ids=[a.name for a in ARCHS])
def test_random_weight_parity(arch, tmp_path_factory, prompt_ids, parity_table):
    from vllm_interp import LLM

    path = build_checkpoint(arch, tmp_path_factory.getbasetemp() / "zoo")
    with _engine_process(arch, path):
        llm = LLM(str(path), model_impl=arch.model_impl, enforce_eager=not arch.compiled,
                  enable_steering=arch.steered, **ENGINE_KWARGS)
        try:
            sequences, readouts = engine_sequences_and_readouts(llm, prompt_ids, MAX_TOKENS)
            num_layers = llm.num_layers
            if arch.steered:
                _check_steering(llm, HookedReference(path, arch.post_attn), prompt_ids)
        finally:
            shutdown(llm)
    references = hf_residuals(path, sequences, arch.post_attn)
    result = compare(readouts, references, num_layers=num_layers)
    parity_table.append((f"{arch.name} ({'compiled' if arch.compiled else 'eager'})", result))
