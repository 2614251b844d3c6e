"""TransformerLens names: the one mapping, and every spec that names a site taking them with the same effect
(steering, capture with either naming, patching, sweeps)."""

import numpy as np
import pytest
import torch

from tests.steering.common import assert_same_output, greedy, moved, tokens_and_logprobs
from vllm_interp import patched_params, steered_params
from vllm_interp.capture.consumers.filesystem import read_capture
from vllm_interp.hooks import canonical_hook, parse_site_name, site_name, site_order
from vllm_interp.patching.sweep import parse_sweep_request


def test_the_mapping_goes_both_ways():
    for layer, hook, name in [(0, "pre_attn", "blocks.0.hook_resid_pre"), (7, "post_attn", "blocks.7.hook_resid_mid"),
                              (29, "post_block", "blocks.29.hook_resid_post")]:
        assert site_name(layer, hook, "transformer_lens") == name
        assert parse_site_name(name) == parse_site_name(site_name(layer, hook)) == (layer, hook)
        assert canonical_hook(name.split(".")[-1]) == hook
    assert sorted(["blocks.2.hook_resid_pre", "1.post_block", "blocks.1.hook_resid_mid"], key=site_order) == [
        "blocks.1.hook_resid_mid", "1.post_block", "blocks.2.hook_resid_pre"]
    for bad in ["blocks.x.hook_resid_pre", "blocks.1.hook_mlp_out", "1.resid_post", "hook_resid_pre"]:
        with pytest.raises(ValueError, match="TransformerLens"):
            parse_site_name(bad)
    assert parse_sweep_request({"prompt": "a", "ablate": True, "hooks": ["hook_resid_pre", "post_block"],
                                "answer_token": "b"}).hooks == ["pre_attn", "post_block"]


def test_capture_takes_transformer_lens_sites_and_names_tensors_either_way(smollm2_llm, prompt_ids, capture_root):
    ours = {"hooks": {"post_block": [3], "pre_attn": [4]}, "positions": "all_prompt"}
    theirs = {"hooks": ["blocks.4.hook_resid_pre", "blocks.3.hook_resid_post"], "positions": "all_prompt",
              "naming": "transformer_lens"}
    prompt = {"prompt_token_ids": prompt_ids[0]}
    a, b = smollm2_llm.generate([prompt, prompt], greedy(1), capture=[
        {"inline": ours}, {"inline": theirs, "filesystem": {**theirs, "tag": "tl-naming"}}])
    assert a.residuals.sites == ["3.post_block", "4.pre_attn"]
    assert b.residuals.sites == ["blocks.3.hook_resid_post", "blocks.4.hook_resid_pre"]
    for mine, tl in zip(a.residuals.sites, b.residuals.sites, strict=True):
        assert torch.equal(a.residuals[mine], b.residuals[tl])
    assert torch.equal(b.residuals[(3, "hook_resid_post")], a.residuals[(3, "post_block")])
    assert torch.equal(b.residuals.stack("post_block"), a.residuals.stack("hook_resid_post"))
    tensors, meta = read_capture(capture_root, "tl-naming")
    assert sorted(tensors) == ["blocks.3.hook_resid_post", "blocks.4.hook_resid_pre"]
    assert meta["layers"] == [3, 4] and torch.equal(tensors["blocks.4.hook_resid_pre"], a.residuals["4.pre_attn"])


def test_steering_and_patching_take_transformer_lens_names(smollm2_llm, prompt_ids):
    vector = (np.random.default_rng(3).standard_normal(576) * 4).tolist()
    source = {"vector": vector}
    requests = [
        steered_params(greedy(), steering_vectors={"post_attn": {5: vector}}),
        steered_params(greedy(), steering_vectors={"hook_resid_mid": {5: vector}}),
        steered_params(greedy(), steering_vectors={"blocks.5.hook_resid_mid": vector}),
        patched_params(greedy(), patch=[{"layer": 2, "hook": "pre_attn", "position": 1, "source": source}]),
        patched_params(greedy(), patch=[{"layer": 2, "hook": "hook_resid_pre", "position": 1, "source": source}]),
        patched_params(greedy(), patch=[{"site": "blocks.2.hook_resid_pre", "position": 1, "source": source}]),
    ]
    outputs = smollm2_llm.generate([{"prompt_token_ids": prompt_ids[0]}] * len(requests), requests)
    results = [tokens_and_logprobs(o) for o in outputs]
    for same in (results[1], results[2]):
        assert_same_output(same, results[0])
    for same in (results[4], results[5]):
        assert_same_output(same, results[3])
    assert moved(results[0], results[3]) > 1e-3
