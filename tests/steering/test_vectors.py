"""The steering spec: wire forms, the one validation, files; and the HTTP field handling with steering off."""

import numpy as np
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from safetensors.numpy import save_file

from vllm_interp import pack_vectors
from vllm_interp.frontend import InterpFrontend
from vllm_interp.hooks import ModelShape
from vllm_interp.server.request_fields import RequestFieldsMiddleware
from vllm_interp.steering.files import load_named_file, parse_named_file
from vllm_interp.steering.state import SteeringState
from vllm_interp.steering.vectors import SiteBlock, SteeringError, SteeringVectors, validate_steering

SHAPE = ModelShape(num_layers=4, hidden_size=8)


def _validate(raw, tier="base", enabled=True):
    return validate_steering({tier: raw}, shape=SHAPE, enabled=enabled)


def test_lists_scaled_entries_and_the_packed_forms_agree():
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal(8).astype(np.float32), rng.standard_normal(8).astype(np.float32)
    plain = _validate({"post_attn": {"1": a.tolist(), "3": {"vector": b.tolist(), "scale": 2.0}}})
    packed = _validate({"post_attn": {**pack_vectors({1: a, 3: b}), "scales": [1.0, 2.0]}})
    for name in ("1.post_attn", "3.post_attn"):
        np.testing.assert_array_equal(plain.tiers["base"][name], packed.tiers["base"][name])
    bf16 = _validate({"post_attn": pack_vectors({1: a}, dtype="bfloat16")}).tiers["base"]["1.post_attn"]
    np.testing.assert_allclose(bf16, a, rtol=1e-2)


def test_tiers_sum_and_digest_identifies_the_vectors():
    one = SteeringVectors({"base": {"0.pre_attn": np.ones(8, np.float32)}})
    two = SteeringVectors({"base": {"0.pre_attn": np.full(8, 2.0, np.float32)},
                           "decode": {"1.post_block": np.ones(8, np.float32)}})
    total = one + two
    np.testing.assert_array_equal(total.tiers["base"]["0.pre_attn"], np.full(8, 3.0))
    np.testing.assert_array_equal(total.phase_vectors("decode")["1.post_block"], np.ones(8))
    assert one.digest() == SteeringVectors.from_wire(one.to_wire()).digest() != two.digest()
    assert not SteeringVectors({"decode": {"1.post_block": np.ones(8, np.float32)}}).affects_prefill


def test_the_wire_carries_a_tier_as_one_block_that_the_worker_reads_in_place():
    """A tier travels as its site names and one buffer of their vectors; decoded, it is a ``SiteBlock`` whose
    matrix views that buffer (a table write copies it once), with every site's vector as it was sent."""
    vectors = SteeringVectors({"base": {"3.post_block": np.arange(4, dtype=np.float32),
                                        "0.pre_attn": np.full(4, -1.5, np.float32)},
                               "decode": {"1.post_attn": np.ones(4, np.float32)}})
    wire = vectors.to_wire()
    assert wire["base"]["sites"] == ["3.post_block", "0.pre_attn"] and len(wire["base"]["data"]) == 2 * 4 * 4
    decoded = SteeringVectors.from_wire(wire)
    block = decoded.tiers["base"]
    assert isinstance(block, SiteBlock) and block.matrix.shape == (2, 4)
    assert not block.matrix.flags.owndata  # a view of the received bytes
    for tier, sites in vectors.tiers.items():
        assert list(decoded.tiers[tier]) == list(sites)
        for name, vector in sites.items():
            np.testing.assert_array_equal(decoded.tiers[tier][name], vector)
    assert decoded.phase_vectors("prefill") is block  # a tier alone is taken as it is
    np.testing.assert_array_equal(decoded.phase_vectors("decode")["1.post_attn"], np.ones(4))
    assert SteeringVectors.from_wire(decoded.to_wire()).to_wire() == wire


def test_the_digest_tells_apart_where_each_vector_goes():
    """The digest hashes every vector in one buffer and the sites' names and sizes after it: the same values
    at other sites, in another tier, or split differently between sites are other specs; the same sites given
    in another order are the same spec."""
    a, b = np.arange(8, dtype=np.float32), np.arange(8, 16, dtype=np.float32)
    digests = [SteeringVectors(tiers).digest() for tiers in [
        {"base": {"0.pre_attn": a, "1.pre_attn": b}},
        {"base": {"0.pre_attn": b, "1.pre_attn": a}},
        {"base": {"0.pre_attn": a, "2.pre_attn": b}},
        {"decode": {"0.pre_attn": a, "1.pre_attn": b}},
        {"base": {"0.pre_attn": a}, "decode": {"1.pre_attn": b}},
        {"base": {"0.pre_attn": np.concatenate([a, b[:4]]), "1.pre_attn": b[4:]}},
    ]]
    assert len(set(digests)) == len(digests)
    assert SteeringVectors({"base": {"1.pre_attn": b, "0.pre_attn": a}}).digest() == digests[0]


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"post_attn": {"1": [0.0] * 7}}, r"steering_vectors\.post_attn\.1: expected 8 values, got 7"),
        ({"post_attn": {"one": [0.0] * 8}}, r"steering_vectors\.post_attn\.one: layer must be an integer"),
        ({"post_attn": {"1": {"vector": [0.0] * 8, "scale": "x"}}}, r"steering_vectors\.post_attn\.1\.scale"),
        ({"post_attn": {"dtype": "float16", "shape": [1, 8], "layers": [1], "data": ""}}, r"post_attn\.dtype"),
        ({"post_attn": {"dtype": "float32", "shape": [1, 9], "layers": [1], "data": ""}}, r"post_attn\.shape"),
        ({"post_attn": {"dtype": "float32", "shape": [1, 8], "layers": [1], "data": "AAAA"}},
         r"post_attn\.data: 3 bytes"),
        ({"post_attn": [1.0]}, r"steering_vectors\.post_attn: expected a layer"),
    ],
)
def test_bad_specs_name_the_field(raw, message):
    with pytest.raises(SteeringError, match=message):
        _validate(raw)


def test_steering_disabled_is_an_error_not_a_no_op():
    with pytest.raises(SteeringError, match="decode_steering_vectors: steering is not enabled"):
        _validate({"post_attn": {"1": [0.0] * 8}}, tier="decode", enabled=False)


def test_named_vector_files(tmp_path):
    save_file({"2.post_block": np.ones(8, np.float32)}, str(tmp_path / "v.safetensors"))
    spec = load_named_file(tmp_path / "v.safetensors")
    assert spec == {"vectors": {"post_block": {"2": [1.0] * 8}}}
    state = SteeringState(SHAPE, enabled=True)
    state.register("v", spec)
    assert "2.post_block" in state.request_vectors({"steering_name": "v"}).tiers["base"]
    with pytest.raises(ValueError, match="expected NAME=PATH"):
        parse_named_file("no-equals-sign")


def test_http_fields_on_an_engine_without_steering_get_400_naming_the_field():
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(body: dict) -> dict:
        return body

    app.add_middleware(RequestFieldsMiddleware)
    app.state.vllm_interp_frontend = InterpFrontend(SteeringState(SHAPE, enabled=False), {}, patching=False,
                                                    max_patch_rows=8)
    client = TestClient(app)
    response = client.post("/v1/completions", json={"prompt": "x", "steering_vectors": {"post_attn": {"1": [0.0] * 8}}})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "steering_vectors"
    patch = [{"layer": 1, "hook": "post_block", "position": 0, "source": {"zeros": True}}]
    response = client.post("/v1/completions", json={"prompt": "x", "patch": patch})
    assert response.status_code == 400 and response.json()["error"]["message"].startswith("patch: patching is not")
    # Requests without steering fields pass through untouched.
    assert client.post("/v1/completions", json={"prompt": "x"}).json() == {"prompt": "x"}
    # A client cannot hand the engine a payload that skipped validation.
    forged = client.post("/v1/completions", json={"prompt": "x", "vllm_xargs": {"vllm_interp": "{}"}})
    assert forged.status_code == 400 and forged.json()["error"]["param"] == "vllm_xargs.vllm_interp"
