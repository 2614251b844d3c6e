"""API keys on every mutating endpoint of ours (docs/limits.md): /v1/steering/set, clear, vectors/register,
vectors/unregister, vectors/contrastive with a name, and DELETE /v1/patch_sources/{run_id}.

The session server takes one key from --steering-api-key and two from VLLM_INTERP_STEERING_API_KEY
(comma-separated); each is accepted in the Authorization: Bearer header and in X-API-Key, anything else is a
401 that changes nothing. A server with steering on and no key configured is open.
"""


import pytest
import requests

from tests.conftest import API_KEY, ENV_API_KEYS, vector

# Every mutating endpoint with a body it accepts, in an order that leaves the server as it found it.
CALLS = [
    ("set", {"vectors": {"pre_attn": {"4": vector(5)}}}),
    ("clear", None),
    ("vectors/register", {"name": "keyed", "decode_vectors": {"post_block": {"2": vector(8)}}}),
    ("vectors/unregister", {"name": "keyed"}),
]
KEYS = {"flag": API_KEY, "env-first": ENV_API_KEYS[0], "env-second": ENV_API_KEYS[1]}
HEADER_FORMS = {
    "bearer": lambda key: {"Authorization": f"Bearer {key}"},
    "x-api-key": lambda key: {"X-API-Key": key},
}


def _post(url: str, endpoint: str, body, headers: dict[str, str] | None = None) -> requests.Response:
    return requests.post(f"{url}/v1/steering/{endpoint}", json=body, headers=headers, timeout=60)


def _state(url: str) -> tuple[dict, dict]:
    return requests.get(f"{url}/v1/steering").json(), requests.get(f"{url}/v1/steering/vectors").json()


@pytest.mark.parametrize("form", HEADER_FORMS)
@pytest.mark.parametrize("source", KEYS)
def test_mutating_endpoints_take_only_a_configured_key(server, source, form):
    url, _ = server
    as_header = HEADER_FORMS[form]
    key = KEYS[source]
    # The whole environment value and a key with a suffix: keys are split on commas and compared whole.
    wrong = [None, as_header("nope"), as_header(",".join(ENV_API_KEYS)), as_header(key + "x")]
    try:
        for endpoint, body in CALLS:
            before = _state(url)
            for headers in wrong:
                reply = _post(url, endpoint, body, headers)
                assert reply.status_code == 401, (endpoint, headers, reply.text)
            assert "API key" in reply.text
            assert _state(url) == before, f"a refused {endpoint} changed the server"
            reply = _post(url, endpoint, body, as_header(key))
            assert reply.status_code == 200, (endpoint, reply.text)
            assert _state(url) != before, f"an accepted {endpoint} did nothing"
    finally:
        _post(url, "clear", None, HEADER_FORMS["bearer"](API_KEY))
        _post(url, "vectors/unregister", {"name": "keyed"}, HEADER_FORMS["bearer"](API_KEY))


# (method, path, body, the answer with a valid key): every mutating endpoint, in an order that leaves the server
# as it found it. A valid key gets the endpoint's normal answer, a 4xx where the body asks for one.
MUTATING = [
    ("POST", "/v1/steering/set", {"vectors": {"pre_attn": {"4": vector(5)}}}, 200),
    ("POST", "/v1/steering/clear", None, 200),
    ("POST", "/v1/steering/vectors/register", {"name": "keyed", "vectors": {"post_block": {"2": vector(8)}}}, 200),
    ("POST", "/v1/steering/vectors/unregister", {"name": "keyed"}, 200),
    ("POST", "/v1/steering/vectors/contrastive",
     {"positive": ["Wonderful"], "negative": ["Terrible"], "layers": [99], "name": "keyed"}, 400),
    ("DELETE", "/v1/patch_sources/never-stored", None, 404),
]


@pytest.mark.parametrize(("method", "path", "body", "status"), MUTATING, ids=[m[1] for m in MUTATING])
def test_every_mutating_endpoint_needs_a_valid_key(server, method, path, body, status):
    url, _ = server
    for headers in [None, HEADER_FORMS["bearer"]("nope"), HEADER_FORMS["x-api-key"]("nope")]:
        reply = requests.request(method, f"{url}{path}", json=body, headers=headers, timeout=60)
        assert reply.status_code == 401 and "API key" in reply.text, (headers, reply.text)
    reply = requests.request(method, f"{url}{path}", json=body, headers=HEADER_FORMS["bearer"](API_KEY), timeout=60)
    assert reply.status_code == status, reply.text


def test_contrastive_without_a_name_needs_no_key(server):
    url, _ = server
    body = {"positive": ["Wonderful"], "negative": ["Terrible"], "layers": [99]}
    reply = requests.post(f"{url}/v1/steering/vectors/contrastive", json=body, timeout=60)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "layers", reply.text


def test_without_a_configured_key_the_endpoints_are_open(open_server):
    for endpoint, body in CALLS:
        before = _state(open_server)
        reply = _post(open_server, endpoint, body)
        assert reply.status_code == 200, (endpoint, reply.text)
        assert _state(open_server) != before, f"an accepted {endpoint} did nothing"
