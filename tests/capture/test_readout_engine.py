"""Read-out edge cases on the shared engine: nothing silent."""

import pytest
from vllm import SamplingParams

from vllm_interp.capture.readout import ReadoutError, ReadoutSpecError


def test_positions_never_computed_fail_the_readout_loudly(smollm2_llm):
    params = SamplingParams(temperature=0.0, max_tokens=2)
    with pytest.raises(ReadoutError, match=r"positions \[400\] were never computed"):
        smollm2_llm.generate(["The capital of France is"], params, readout={"positions": [0, 400]}, use_tqdm=False)
    with pytest.raises(ReadoutSpecError, match="readout.layers"):
        smollm2_llm.generate(["x"], params, readout={"layers": [30]}, use_tqdm=False)


def test_generated_positions_and_sites_are_described(smollm2_llm):
    (sites,) = smollm2_llm.describe_sites()
    assert sites["layers"] == list(range(30)) and sites["hooks"] == ["pre_attn", "post_attn", "post_block"]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    (out,) = smollm2_llm.generate(["The capital of France is"], params, use_tqdm=False,
                                  readout={"layers": [3], "hooks": ["post_attn"], "positions": "all_generated"})
    prompt_len = len(out.prompt_token_ids)
    # Four generated tokens, the last never fed back: three generated positions have a residual.
    assert out.residuals.positions == [prompt_len, prompt_len + 1, prompt_len + 2]
    assert out.residuals.sites == ["3.post_attn"] and out.residuals["3.post_attn"].shape == (3, 576)
