"""Contrastive vectors (offline and ``POST /v1/steering/vectors/contrastive``) against transformers' residuals
on the same prompts, registration under a name, and the endpoint's errors."""

import numpy as np
import pytest
import requests

from tests.conftest import API_KEY
from tests.parity import REL_TOL
from tests.steering.common import assert_same_output, greedy, tokens_and_logprobs
from vllm_interp import steered_params
from vllm_interp.steering.vectors import SteeringError

POSITIVE = ["I love this movie, it is wonderful", "What a happy and bright morning", "Thank you so much!"]
NEGATIVE = ["I hate this movie, it is awful", "What a sad and gloomy morning"]
LAYERS = [3, 12]


def reference_vectors(reference, tokenizer, positions: str, normalize: bool = False):
    """mean over prompts of each prompt's last (or mean) post_block row, positive minus negative; and per layer
    the scale the parity tolerance applies to (the rows' max, as for every residual comparison)."""
    def side(prompts, layer):
        rows = [reference.run(tokenizer(p).input_ids).sites[f"{layer}.post_block"].double().numpy() for p in prompts]
        return np.mean([r[-1] if positions == "last_prompt" else r.mean(axis=0) for r in rows], axis=0)

    vectors, scales = {}, {}
    for layer in LAYERS:
        positive, negative = side(POSITIVE, layer), side(NEGATIVE, layer)
        diff, norm = positive - negative, np.linalg.norm(positive - negative)
        scale = max(np.abs(positive).max(), np.abs(negative).max())
        vectors[layer], scales[layer] = (diff / norm, scale / norm) if normalize else (diff, scale)
    return vectors, scales


def assert_vectors_close(got: dict, want: tuple[dict, dict]) -> None:
    vectors, scales = want
    for layer, vector in vectors.items():
        error = np.abs(np.asarray(got[layer]) - vector).max() / scales[layer]
        assert error <= REL_TOL, f"layer {layer}: difference {error:.2e} (relative to the rows) from transformers"


@pytest.mark.parametrize("positions", ["last_prompt", "mean_prompt"])
def test_offline_vectors_equal_transformers(smollm2_llm, smollm2_reference, smollm2_tokenizer, positions):
    result = smollm2_llm.contrastive_vector(POSITIVE, NEGATIVE, hook="hook_resid_post", layers=LAYERS,
                                            positions=positions)
    want = reference_vectors(smollm2_reference, smollm2_tokenizer, positions)
    assert result.hook == "post_block" and result.layers == LAYERS
    assert_vectors_close(result.vectors, want)
    for layer in LAYERS:
        assert result.norms[layer] == pytest.approx(np.linalg.norm(want[0][layer]), rel=1e-3)


def test_a_named_normalized_vector_is_registered_and_steers(smollm2_llm, smollm2_reference, smollm2_tokenizer,
                                                             prompt_ids):
    result = smollm2_llm.contrastive_vector(POSITIVE, NEGATIVE, layers=LAYERS, normalize=True, name="joy")
    try:
        assert_vectors_close(result.vectors, reference_vectors(smollm2_reference, smollm2_tokenizer,
                                                               "last_prompt", normalize=True))
        assert "joy" in smollm2_llm.list_steering_vectors()
        prompt = {"prompt_token_ids": prompt_ids[0]}
        by_name, inline = smollm2_llm.generate([prompt, prompt], [
            steered_params(greedy(), steering_name="joy"),
            steered_params(greedy(), steering_vectors=result.steering_spec())])
        assert_same_output(tokens_and_logprobs(by_name), tokens_and_logprobs(inline))
    finally:
        smollm2_llm.unregister_steering_vectors("joy")


def test_offline_arguments_are_checked(smollm2_llm):
    for kwargs, message in [({"layers": [30]}, "layers: .30. out of range"), ({"layers": []}, "layers: name"),
                            ({"layers": [1], "hook": "resid"}, "hook"), ({"layers": [1], "positions": "all"},
                                                                         "positions")]:
        with pytest.raises(SteeringError, match=message):
            smollm2_llm.contrastive_vector(POSITIVE, NEGATIVE, **kwargs)
    with pytest.raises(SteeringError, match="negative"):
        smollm2_llm.contrastive_vector(POSITIVE, [], layers=[1])


def test_http_endpoint_equals_transformers_and_registers_with_a_key(server, smollm2_reference, smollm2_tokenizer):
    url, _ = server
    body = {"positive": POSITIVE, "negative": NEGATIVE, "hook": "post_block", "layers": LAYERS,
            "positions": "mean_prompt"}
    answer = requests.post(f"{url}/v1/steering/vectors/contrastive", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    data = answer.json()
    assert data["name"] is None and data["layers"] == LAYERS and set(data["norms"]) == {"3", "12"}
    from vllm_interp.hooks import ModelShape
    from vllm_interp.steering.vectors import validate_steering_tier

    vectors = validate_steering_tier({"post_block": data["vectors"]}, where="vectors", shape=ModelShape(30, 576))
    assert_vectors_close({layer: vectors[f"{layer}.post_block"] for layer in LAYERS},
                         reference_vectors(smollm2_reference, smollm2_tokenizer, "mean_prompt"))

    named = {**body, "name": "joy-http"}
    assert requests.post(f"{url}/v1/steering/vectors/contrastive", json=named, timeout=60).status_code == 401
    answer = requests.post(f"{url}/v1/steering/vectors/contrastive", json=named, timeout=120,
                           headers={"Authorization": f"Bearer {API_KEY}"})
    assert answer.status_code == 200 and answer.json()["name"] == "joy-http"
    try:
        assert "joy-http" in requests.get(f"{url}/v1/steering/vectors", timeout=10).json()["names"]
    finally:
        requests.post(f"{url}/v1/steering/vectors/unregister", json={"name": "joy-http"}, timeout=10,
                      headers={"Authorization": f"Bearer {API_KEY}"})


@pytest.mark.parametrize("change,param", [({"layers": [99]}, "layers"), ({"positive": []}, "positive"),
                                          ({"hook": "mlp_out"}, "hook"), ({"positions": "all"}, "positions"),
                                          ({"extra": 1}, "extra"), ({"positive": "one prompt"}, "positive")])
def test_http_endpoint_names_the_bad_field(server, change, param):
    url, _ = server
    body = {"positive": POSITIVE, "negative": NEGATIVE, "layers": LAYERS, **change}
    answer = requests.post(f"{url}/v1/steering/vectors/contrastive", json=body, timeout=60)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == param, answer.text
