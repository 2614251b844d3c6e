"""Steering over HTTP on `vllm-interp serve` (the session server fixture in conftest.py): request fields through
the openai client's extra_body, /v1/steering/*, 400s that name the field (API keys: test_auth.py)."""

import json
import math

import numpy as np
import pytest
import requests
from openai import OpenAI

from tests.conftest import API_KEY, HIDDEN, vector
from vllm_interp import pack_vectors

PROMPT = "The capital of France is"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _complete(url, **extra):
    client = OpenAI(base_url=f"{url}/v1", api_key="unused")
    model = client.models.list().data[0].id
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=1,
                                    extra_body=extra or None)
    choice = out.choices[0]
    return choice.text, choice.logprobs.token_logprobs


def _moved(a, b) -> float:
    return 1.0 if a[0] != b[0] else max(abs(x - y) for x, y in zip(a[1], b[1], strict=True))


def test_request_fields_steer_streaming_and_not(server):
    url, _ = server
    base = _complete(url)
    spec = {"post_block": {"6": vector(1)}}
    steered = _complete(url, steering_vectors=spec)
    assert _moved(base, steered) > 0.01
    client = OpenAI(base_url=f"{url}/v1", api_key="unused")
    model = client.models.list().data[0].id
    stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0, stream=True,
                                       extra_body={"steering_vectors": spec})
    assert "".join(chunk.choices[0].text for chunk in stream) == steered[0]

    def chat(**extra):
        reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=4, temperature=0, logprobs=True, extra_body=extra or None)
        choice = reply.choices[0]
        return choice.message.content, [t.logprob for t in choice.logprobs.content]

    plain_chat, steered_chat = chat(), chat(prefill_steering_vectors=spec)
    # Prefill steering moves the last prompt token's residual, which the first token is sampled from: the text
    # changes, or (same tokens) a logprob moves far past fp32 round-off (here the first one, by 0.14).
    assert _moved(steered_chat, plain_chat) > 0.01, (plain_chat, steered_chat)
    assert _moved(chat(), plain_chat) < 1e-5  # and only that request


def test_compact_base64_form_equals_json_floats(server):
    url, _ = server
    floats = {"post_attn": {"9": vector(2), "11": vector(3)}}
    packed = {"post_attn": pack_vectors({9: vector(2), 11: vector(3)})}
    assert _complete(url, decode_steering_vectors=floats) == _complete(url, decode_steering_vectors=packed)


def test_named_vectors_loaded_at_start_up(server):
    url, _ = server
    assert requests.get(f"{url}/v1/steering/vectors").json() == {"names": ["formal"]}
    assert _complete(url, steering_name="formal") == _complete(url, steering_vectors={"post_block": {"6": vector(42)}})


def test_global_steering_moves_the_output_and_clearing_restores_the_baseline(server):
    url, _ = server
    base = _complete(url)
    body = {"vectors": {"pre_attn": {"4": vector(5)}}}
    try:
        response = requests.post(f"{url}/v1/steering/set", json=body, headers=AUTH)
        assert response.status_code == 200, response.text
        assert list(requests.get(f"{url}/v1/steering").json()["vectors"]["pre_attn"]) == ["4"]
        assert _moved(base, _complete(url)) > 0.01
    finally:
        assert requests.post(f"{url}/v1/steering/clear", headers=AUTH).status_code == 200
    assert _complete(url) == base
    layers = requests.get(f"{url}/v1/steering/layers").json()
    assert layers["num_layers"] == 30 and layers["hidden_size"] == HIDDEN and layers["hooks"][0] == "pre_attn"


def test_named_vectors_register_and_unregister(server):
    url, _ = server
    body = {"name": "tmp", "decode_vectors": {"post_block": {"2": vector(8)}}}
    assert requests.post(f"{url}/v1/steering/vectors/register", json=body, headers=AUTH).status_code == 200
    assert _complete(url, steering_name="tmp") == _complete(url, decode_steering_vectors=body["decode_vectors"])
    assert requests.post(f"{url}/v1/steering/vectors/unregister", json={"name": "tmp"}, headers=AUTH).ok
    assert requests.get(f"{url}/v1/steering/vectors").json() == {"names": ["formal"]}


BAD = [
    ({"steering_vectors": {"post_block": {"3": [1.0, 2.0]}}}, "steering_vectors.post_block.3"),
    ({"steering_vectors": {"post_block": {"3": [math.nan] * HIDDEN}}}, "steering_vectors.post_block.3"),
    ({"prefill_steering_vectors": {"mlp_out": {"3": [0.0] * HIDDEN}}}, "prefill_steering_vectors.mlp_out"),
    ({"decode_steering_vectors": {"pre_attn": {"30": [0.0] * HIDDEN}}}, "decode_steering_vectors.pre_attn.30"),
    ({"steering_name": "nosuch"}, "steering_name"),
    ({"steering_vectors": {"post_block": {"dtype": "float32", "shape": [1, HIDDEN], "layers": [3], "data": "%%"}}},
     "steering_vectors.post_block.data"),
]


@pytest.mark.parametrize(("fields", "param"), BAD, ids=[p for _, p in BAD])
def test_bad_input_gets_400_naming_the_field_and_the_engine_keeps_serving(server, fields, param):
    url, _ = server
    body = {"model": requests.get(f"{url}/v1/models").json()["data"][0]["id"], "prompt": PROMPT, "max_tokens": 2,
            **fields}
    # json.dumps writes NaN as the literal NaN, which the server's parser accepts: the check must catch it.
    response = requests.post(f"{url}/v1/completions", data=json.dumps(body),
                             headers={"Content-Type": "application/json"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert _complete(url)[0].startswith(" Paris")


def test_bad_global_spec_gets_400(server):
    url, _ = server
    response = requests.post(f"{url}/v1/steering/set", json={"vectors": {"post_block": {"99": [0.0] * HIDDEN}}},
                             headers=AUTH)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "vectors.post_block.99"
    assert np.isfinite(_complete(url)[1]).all()
