"""Capture edge cases on the shared engine: nothing silent."""

import pytest
from vllm import SamplingParams

from vllm_interp.capture.spec import CaptureSpecError
from vllm_interp.llm import CaptureError


def test_positions_never_computed_fail_loudly(smollm2_llm):
    params = SamplingParams(temperature=0.0, max_tokens=2)
    with pytest.raises(CaptureError, match=r"positions \[400\] were never computed"):
        smollm2_llm.generate(["The capital of France is"], params, readout={"positions": [0, 400]}, use_tqdm=False)
    (out,) = smollm2_llm.generate(["The capital of France is"], params, use_tqdm=False,
                                  capture={"inline": {"positions": [0, 400]}})
    assert out.capture["inline"].status == "error" and "never computed" in out.capture["inline"].message


@pytest.mark.parametrize(
    ("capture", "message"),
    [
        ({"inline": {"hooks": {"post_attn": [30]}}}, r"capture\.inline\.hooks\.post_attn: layers \[30\] out of range"),
        ({"inline": {"hooks": {"mlp_out": [1]}}}, r"capture\.inline\.hooks\.mlp_out"),
        ({"inline": {"positions": "first"}}, r"capture\.inline\.positions"),
        ({"inline": {"positions": [3, 3]}}, r"capture\.inline\.positions: .*repeat"),
        ({"inline": {"tag": "../up"}}, r"capture\.inline\.tag"),
        ({"inline": {"colour": "red"}}, r"capture\.inline\.colour: unknown option"),
        ({"nosuch": {}}, r"capture\.nosuch: consumer not enabled on this engine \(enabled: .*inline"),
    ],
)
def test_bad_specs_are_refused_naming_the_field(smollm2_llm, capture, message):
    with pytest.raises(CaptureSpecError, match=message):
        smollm2_llm.generate(["x"], SamplingParams(max_tokens=1), capture=capture, use_tqdm=False)


def test_generated_positions_and_sites_are_described(smollm2_llm):
    (sites,) = smollm2_llm.describe_sites()
    assert sites["layers"] == list(range(30)) and sites["hooks"] == ["pre_attn", "post_attn", "post_block"]
    assert sites["runner"] == "V1"  # vLLM runs V2 on GPUs only
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    (out,) = smollm2_llm.generate(["The capital of France is"], params, use_tqdm=False,
                                  readout={"hooks": {"post_attn": [3]}, "positions": "all_generated"})
    prompt_len = len(out.prompt_token_ids)
    # Four generated tokens, the last never fed back: three generated positions have a residual.
    assert out.residuals.positions == [prompt_len, prompt_len + 1, prompt_len + 2]
    assert out.residuals.sites == ["3.post_attn"] and out.residuals["3.post_attn"].shape == (3, 576)
    assert out.capture["inline"].status == "ok" and out.capture["inline"].rows == 3
