"""Limits and security (docs/limits.md): bodies that cannot crash parsing, the bounds and their flags, vector
name syntax, path safety, and the refusal of several engines (data parallelism).

The HTTP cases run against the shared `server` fixture (default limits); bounds whose defaults that server
cannot reach (capture bytes on a 512-token model, the named-vector count) run through the same code without
an engine: the middleware against a scripted vLLM, ``SteeringState`` with small limits.
"""

import asyncio
import builtins
import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import requests
import torch
from fastapi import HTTPException
from starlette.datastructures import State
from starlette.requests import Request

from tests.conftest import API_KEY, HIDDEN, VLLM_INTERP, vector
from vllm_interp import pack_vectors
from vllm_interp.capture.consumer import CaptureMeta, ConsumerContext, EngineFacts, RequestCapture
from vllm_interp.capture.consumers.filesystem import FilesystemConsumer
from vllm_interp.capture.consumers.inline import InlineConsumer
from vllm_interp.capture.consumers.logging import LoggingConsumer
from vllm_interp.capture.limits import check_capture_bytes
from vllm_interp.capture.spec import CaptureSpecError, validate_capture_spec
from vllm_interp.config import FrontendLimits
from vllm_interp.frontend import InterpFrontend
from vllm_interp.hooks import ModelShape
from vllm_interp.patching.sources import SourceRun, SourceStore
from vllm_interp.server.auth import require_key
from vllm_interp.server.bodies import MAX_JSON_DEPTH
from vllm_interp.server.request_fields import RequestFieldsMiddleware
from vllm_interp.steering.state import SteeringState
from vllm_interp.steering.vectors import SteeringError

AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = "The capital of France is"
LAYERS = 30
# Every POST route of ours (the mutating ones with the key, so that the body is what gets judged).
POST_ROUTES = ["/v1/completions", "/v1/chat/completions", "/v1/steering/set", "/v1/steering/clear",
               "/v1/steering/vectors/register", "/v1/steering/vectors/unregister",
               "/v1/steering/vectors/contrastive", "/v1/patch_sweep"]
NESTED = b"[" * 100_000 + b"]" * 100_000


def _refused(reply: requests.Response, param: str, status: int = 400) -> dict:
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["message"].startswith(param), error
    return error


def _still_serves(url: str) -> None:
    reply = requests.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "temperature": 0},
                          timeout=60)
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"].startswith(" Paris"), reply.text


# -- bodies --------------------------------------------------------------------------------------------------------


BAD_BODIES = {
    "nested-100k": (NESTED, "application/json"),
    "nested-just-over": (b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1), "application/json"),
    "nested-in-a-field": (b'{"prompt": "x", "capture": ' + b"[" * 5000 + b"]" * 5000 + b"}", "application/json"),
    "not-json": (b"prompt=hello", "application/json"),
    "not-utf8": (b'{"prompt": "\xff\xfe"}', "application/json"),
    "form-content-type": (json.dumps({"prompt": PROMPT}).encode(), "application/x-www-form-urlencoded"),
    "text-content-type": (json.dumps({"prompt": PROMPT}).encode(), "text/plain"),
}


@pytest.mark.parametrize("route", POST_ROUTES)
@pytest.mark.parametrize("case", BAD_BODIES)
def test_bodies_that_are_not_json_or_nest_too_deep_get_400_naming_body(server, route, case):
    url, _ = server
    body, content_type = BAD_BODIES[case]
    reply = requests.post(f"{url}{route}", data=body, headers={**AUTH, "Content-Type": content_type}, timeout=60)
    _refused(reply, "body")


def test_a_body_of_100k_nested_lists_leaves_the_server_serving(server):
    url, _ = server
    for route in POST_ROUTES:
        requests.post(f"{url}{route}", data=NESTED, headers=AUTH, timeout=60)
    _still_serves(url)


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_a_body_with_our_fields_over_the_byte_bound_gets_413(server, route):
    url, _ = server
    padding = "x" * (16 << 20)
    body = {"prompt": PROMPT, "messages": [{"role": "user", "content": padding}], "max_tokens": 1,
            "steering_vectors": {"post_block": {"3": vector(1)}}}
    _refused(requests.post(f"{url}{route}", json=body, timeout=120), "body", status=413)


def test_a_route_body_over_the_byte_bound_gets_413_before_it_is_parsed(server):
    url, _ = server
    body = b'{"vectors": {}, "pad": "' + b"x" * (16 << 20) + b'"}'
    reply = requests.post(f"{url}/v1/steering/set", data=body, headers={**AUTH, "Content-Type": "application/json"},
                          timeout=120)
    _refused(reply, "body", status=413)


def test_clear_takes_an_empty_body_or_an_empty_object_only(server):
    url, _ = server
    assert requests.post(f"{url}/v1/steering/clear", headers=AUTH, timeout=60).status_code == 200
    assert requests.post(f"{url}/v1/steering/clear", json={}, headers=AUTH, timeout=60).status_code == 200
    _refused(requests.post(f"{url}/v1/steering/clear", json={"everything": True}, headers=AUTH, timeout=60),
             "everything")


# -- steering bounds and names ---------------------------------------------------------------------------------------


def _every_site() -> dict:
    """A tier's spec steering every hook of every layer (90 sites on SmolLM2), in the compact form."""
    return {hook: pack_vectors({layer: vector(layer, 0.01) for layer in range(LAYERS)}, dtype="bfloat16")
            for hook in ("pre_attn", "post_attn", "post_block")}


def test_more_site_vectors_than_the_default_bound_get_400(server):
    url, _ = server
    every = _every_site()
    body = {"prompt": PROMPT, "max_tokens": 1, "steering_vectors": every, "prefill_steering_vectors": every,
            "decode_steering_vectors": {"post_block": every["post_block"]}}
    # 90 + 90 + 30 = 210 sites are within 256...
    assert requests.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
    # ... 270 are not; the error names the first of the tiers holding most.
    error = _refused(requests.post(f"{url}/v1/completions", json={**body, "decode_steering_vectors": every},
                                   timeout=60), "steering_vectors")
    assert "270 site vectors" in error["message"] and "--max-steering-sites-per-request" in error["message"]
    _refused(requests.post(f"{url}/v1/steering/vectors/register", headers=AUTH, timeout=60,
                           json={"name": "huge", "vectors": every, "prefill_vectors": every,
                                 "decode_vectors": every}), "vectors")
    assert "huge" not in requests.get(f"{url}/v1/steering/vectors", timeout=10).json()["names"]


BAD_NAMES = ["../x", "a/b", "/abs", "..", "a..b", ".hidden", "x\x00y", "a\\b", "", "é", "n" * 65, "n" * 10_000]
GOOD_REGISTER = {"vectors": {"post_block": {"2": vector(8)}}}


@pytest.mark.parametrize("name", BAD_NAMES, ids=[repr(n)[:20] for n in BAD_NAMES])
def test_bad_vector_names_are_refused_everywhere(server, name):
    url, _ = server
    before = requests.get(f"{url}/v1/steering/vectors", timeout=10).json()

    def post(path: str, body: dict) -> requests.Response:
        return requests.post(f"{url}/v1/steering/{path}", json=body, headers=AUTH, timeout=60)

    error = _refused(post("vectors/register", {"name": name, **GOOD_REGISTER}), "name")
    assert len(error["message"]) < 400, "the name is echoed in full"
    _refused(post("vectors/unregister", {"name": name}), "name")
    contrastive = {"positive": ["Great"], "negative": ["Awful"], "layers": [3], "name": name}
    _refused(post("vectors/contrastive", contrastive), "name")
    reply = requests.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 1, "steering_name": name},
                          timeout=60)
    _refused(reply, "steering_name")
    assert requests.get(f"{url}/v1/steering/vectors", timeout=10).json() == before


def _state(**limits) -> SteeringState:
    return SteeringState(ModelShape(4, 8), enabled=True, limits=FrontendLimits(**limits))


def test_the_named_vector_count_is_bounded_and_a_replacement_always_fits():
    state = _state(max_named_vectors=2)
    spec = {"vectors": {"post_block": {"1": [1.0] * 8}}}
    state.register("a", spec)
    state.register("b", spec)
    with pytest.raises(SteeringError, match=r"^name: 2 named entries .*--max-named-vectors"):
        state.register("c", spec)
    state.register("b", spec)
    state.unregister("a")
    state.register("c", spec)
    assert sorted(state.named) == ["b", "c"]


def test_the_site_bound_counts_all_tiers_and_the_named_vectors():
    state = _state(max_steering_sites_per_request=3)
    state.register("two", {"vectors": {"post_block": {"0": [1.0] * 8, "1": [1.0] * 8}}})
    own = {"decode_steering_vectors": {"pre_attn": {"2": [1.0] * 8}}}
    assert len(state.request_vectors({**own, "steering_name": "two"}).tiers["base"]) == 2
    with pytest.raises(SteeringError, match=r"^steering_vectors: 4 site vectors"):
        state.request_vectors({**own, "prefill_steering_vectors": {"pre_attn": {"3": [1.0] * 8}},
                               "steering_name": "two"})
    with pytest.raises(SteeringError, match=r"^prefill_vectors: 4 site vectors"):
        state.plan_set({"prefill_vectors": {"post_attn": {str(layer): [1.0] * 8 for layer in range(4)}}})


LIMIT_FLAGS = ["--max-interp-body-bytes", "--max-steering-sites-per-request", "--max-named-vectors",
               "--max-capture-bytes-per-request", "--max-sweep-cells"]


def test_limit_flags_are_listed_and_a_bad_value_stops_the_start():
    help_text = subprocess.run([VLLM_INTERP, "serve", "--help=vllm-interp"], capture_output=True, text=True,
                               check=True).stdout
    assert all(flag in help_text for flag in LIMIT_FLAGS)
    out = subprocess.run([VLLM_INTERP, "serve", "--enable-steering", "--max-named-vectors", "0"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "--max-named-vectors must be a positive integer" in out.stdout + out.stderr
    for flag in LIMIT_FLAGS:
        field = flag.removeprefix("--").replace("-", "_")
        with pytest.raises(ValueError, match=f"^{flag} must be a positive integer"):
            FrontendLimits(**{field: 0})
        assert getattr(FrontendLimits.from_args(SimpleNamespace(**{field: 7})), field) == 7


@pytest.mark.parametrize(("flags", "message"), [
    (["--steering-vectors", "../up={path}"], "--steering-vectors NAME: '../up' is not a vector name"),
    (["--max-named-vectors", "1", "--steering-vectors", "a={path}", "--steering-vectors", "b={path}"],
     "--steering-vectors: 2 named entries, more than --max-named-vectors 1"),
], ids=["bad-name", "too-many"])
def test_named_files_are_checked_before_the_start(tmp_path, flags, message):
    path = tmp_path / "v.json"
    path.write_text(json.dumps(GOOD_REGISTER))
    out = subprocess.run([VLLM_INTERP, "serve", "--enable-steering", *(f.format(path=path) for f in flags)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and message in out.stdout + out.stderr


# -- capture bytes ---------------------------------------------------------------------------------------------------


SPEC_ARGS = {"engine": EngineFacts(LAYERS), "consumers": {"inline": InlineConsumer}}


def _spec(**entry) -> dict:
    return validate_capture_spec({"inline": entry}, **SPEC_ARGS)


@pytest.mark.parametrize(("positions", "prompt_len", "max_tokens", "rows"), [
    ("all", None, None, 512),          # nothing known: max_model_len
    ("all", 10, 5, 15),
    ("all", 500, 100, 512),            # capped at max_model_len
    ("all_prompt", None, 5, 512),
    ("all_prompt", 10, None, 10),
    ("last_prompt", None, None, 1),
    ("all_generated", None, 7, 7),
    ("all_generated", 10, None, 502),
    ([0, 3, 20], 10, 5, 2),            # entries past the sequence never exist
])
def test_the_capture_bound_counts_the_worst_case_rows(positions, prompt_len, max_tokens, rows):
    spec = _spec(hooks={"post_block": [1, 2]}, positions=positions)
    row_bytes = 2 * HIDDEN * 4
    bound = {"consumers": SPEC_ARGS["consumers"], "num_layers": LAYERS, "hidden_size": HIDDEN,
             "prompt_len": prompt_len, "max_tokens": max_tokens, "max_model_len": 512}
    check_capture_bytes(spec, **bound, limit=rows * row_bytes)
    with pytest.raises(CaptureSpecError, match=rf"^capture\.inline: up to {rows * row_bytes} bytes"):
        check_capture_bytes(spec, **bound, limit=rows * row_bytes - 1)


def test_a_consumer_taking_row_summaries_is_bounded_by_their_width():
    """logging takes five statistics per row, reduced on the device, not the row: the bound counts those."""
    spec = validate_capture_spec({"logging": {"hooks": {"post_block": [1, 2]}, "positions": "all"}},
                                 engine=EngineFacts(LAYERS), consumers={"logging": LoggingConsumer})
    bound = {"consumers": {"logging": LoggingConsumer}, "num_layers": LAYERS, "hidden_size": HIDDEN,
             "prompt_len": 10, "max_tokens": 5, "max_model_len": 512}
    summary_bytes = 15 * 2 * 5 * 4
    check_capture_bytes(spec, **bound, limit=summary_bytes)
    with pytest.raises(CaptureSpecError, match=r"15 positions x 2 sites x 5 x 4 bytes = 600;"):
        check_capture_bytes(spec, **bound, limit=summary_bytes - 1)


class _Tokenizer:
    def encode(self, text: str) -> list[int]:
        return list(range(len(text.split())))


def _admit(body: dict, limits: FrontendLimits, max_model_len: int = 8192) -> tuple[int, dict | None]:
    """``body`` through the middleware to a scripted vLLM (which answers 500, so nothing is collected); the
    status the client got and the request vLLM got (None when the middleware refused it)."""
    state = State()
    state.vllm_interp_frontend = InterpFrontend(SteeringState(ModelShape(LAYERS, HIDDEN), enabled=True),
                                                {"inline": InlineConsumer}, patching=False, max_patch_rows=8)
    state.vllm_interp_limits = limits
    state.vllm_interp_max_model_len = max_model_len
    state.engine_client = SimpleNamespace(get_tokenizer=_Tokenizer)
    seen, status = [], []

    async def vllm(scope, receive, send):
        seen.append(json.loads((await receive())["body"]))
        await send({"type": "http.response.start", "status": 500, "headers": []})
        await send({"type": "http.response.body", "body": b"{}", "more_body": False})

    async def receive():
        return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}

    async def client(message):
        if message["type"] == "http.response.start":
            status.append(message["status"])

    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    scope = {"type": "http", "method": "POST", "path": path, "headers": [], "app": SimpleNamespace(state=state)}
    asyncio.run(RequestFieldsMiddleware(vllm)(scope, receive, client))
    return status[0], seen[0] if seen else None


def _capture_limit(limit: int) -> FrontendLimits:
    return FrontendLimits(max_capture_bytes_per_request=limit)


EVERY_SITE_ALL_PROMPT = {"inline": {"hooks": "all", "positions": "all_prompt"}}
ROW_BYTES = 3 * LAYERS * HIDDEN * 4  # one position of every site


def test_admission_refuses_a_capture_over_the_bound_and_names_the_consumer():
    # A chat prompt's length is unknown at admission: it counts as max_model_len tokens.
    chat = {"messages": [{"role": "user", "content": "hi"}], "capture": EVERY_SITE_ALL_PROMPT}
    assert _admit(chat, _capture_limit(100 * ROW_BYTES), max_model_len=101) == (400, None)
    status, forwarded = _admit(chat, _capture_limit(101 * ROW_BYTES), max_model_len=101)
    assert status == 500 and forwarded is not None


def test_a_text_prompt_is_tokenized_only_to_rescue_a_capture_the_conservative_bound_refuses():
    prompt = "one two three four five"  # five tokens for the scripted tokenizer
    body = {"prompt": prompt, "max_tokens": 3, "capture": EVERY_SITE_ALL_PROMPT}
    assert _admit(body, _capture_limit(5 * ROW_BYTES))[0] == 500
    assert _admit(body, _capture_limit(5 * ROW_BYTES - 1))[0] == 400
    assert _admit({**body, "prompt": list(range(5))}, _capture_limit(5 * ROW_BYTES))[0] == 500
    assert _admit({**body, "prompt": list(range(6))}, _capture_limit(5 * ROW_BYTES))[0] == 400


@pytest.mark.parametrize(("body", "status"), [
    ({"prompt": "x" * 2000}, 500),                          # no field of ours: vLLM's business
    ({"prompt": "x" * 2000, "steering_name": "n"}, 413),
    ({"prompt": "x" * 100, "capture": {"inline": {}}}, 500),
])
def test_the_body_bound_applies_only_to_bodies_with_our_fields(body, status):
    assert _admit(body, FrontendLimits(max_interp_body_bytes=1000))[0] == status


# -- paths -----------------------------------------------------------------------------------------------------------


BAD_TAGS = ["..", "../x", "a/../../x", "/etc/passwd", "a\x00b", "a\\b", "C:\\x", "a//b", ".hidden", "x/"]


@pytest.mark.parametrize("tag", BAD_TAGS, ids=[repr(t) for t in BAD_TAGS])
def test_unsafe_capture_tags_are_refused_at_admission(server, tag):
    url, _ = server
    for consumer in ("filesystem", "patch_source"):
        body = {"prompt": PROMPT, "max_tokens": 1, "capture": {consumer: {"tag": tag}}}
        _refused(requests.post(f"{url}/v1/completions", json=body, timeout=60), f"capture.{consumer}.tag")


def _consumer(root: Path, **options: str) -> FilesystemConsumer:
    validated = FilesystemConsumer.validate_engine_options({"root": str(root), **options})
    return FilesystemConsumer(ConsumerContext("filesystem", validated, "m", num_layers=4, hidden_size=8))


def _capture(tag: str) -> RequestCapture:
    meta = CaptureMeta(request_id="r", tag=tag, model="m", prompt_len=2, positions=[0, 1], sites=["1.post_block"],
                       dtype="float32", options={})
    return RequestCapture(meta, {"1.post_block": torch.ones(2, 8)})


@pytest.mark.parametrize("link", ["shards", "shards/index.jsonl"])
def test_a_sharded_write_never_follows_a_link_out_of_the_root(tmp_path, link):
    root, outside = tmp_path / "root", tmp_path / "outside"
    outside.mkdir()
    consumer = _consumer(root, layout="sharded", shard_mb="1")
    if link == "shards":
        (root / "shards").symlink_to(outside, target_is_directory=True)
    else:
        (root / "shards").mkdir()
        (outside / "index.jsonl").write_text("")
        (root / "shards" / "index.jsonl").symlink_to(outside / "index.jsonl")
    with pytest.raises(ValueError, match="^root: .* leading outside the capture root"):
        consumer.consume(_capture("t"))
    consumer.close()
    assert {p.name: p.read_text() for p in outside.iterdir()} == ({} if link == "shards" else {"index.jsonl": ""})


def test_a_tag_through_a_linked_directory_writes_nothing_outside(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    outside.mkdir()
    consumer = _consumer(root, layout="per_file")
    (root / "runs").symlink_to(outside, target_is_directory=True)
    with pytest.raises(ValueError, match="^tag: 'runs/one' resolves outside"):
        consumer.consume(_capture("runs/one"))
    assert list(outside.iterdir()) == []


def test_patch_source_run_ids_never_touch_the_filesystem(monkeypatch):
    def no_files(*args, **kwargs):
        raise AssertionError(f"the source store touched the filesystem: {args}")

    for module, name in [(builtins, "open"), (os, "open"), (os, "stat"), (os, "remove"), (os, "unlink")]:
        monkeypatch.setattr(module, name, no_files)
    store = SourceStore(budget_bytes=1 << 20)
    for run_id in ["../../etc/passwd", "/etc/passwd", "a\x00b", "C:\\Windows"]:
        store.put(SourceRun(run_id, 2, [0, 1], {"1.post_block": torch.zeros(2, 8)}))
        assert store.acquire(run_id, [store.describe()[run_id]["generation"]], "req") is not None
        assert store.delete(run_id)


def test_unknown_and_traversing_run_ids_are_just_unknown(server):
    url, _ = server
    reply = requests.delete(f"{url}/v1/patch_sources/%2E%2E%2F%2E%2E%2Fetc%2Fpasswd", headers=AUTH, timeout=60)
    assert reply.status_code == 404 and reply.json()["error"]["param"] == "run_id", reply.text
    sweep = {"prompt": PROMPT, "source_run": "../../etc/passwd", "answer_token": " Paris"}
    _refused(requests.post(f"{url}/v1/patch_sweep", json=sweep, timeout=60), "source_run")
    patch = [{"layer": 1, "hook": "post_block", "position": 0, "source": {"run": "/etc/passwd", "position": 0}}]
    _refused(requests.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 1, "patch": patch},
                           timeout=60), "patch.0.source.run")


# -- API keys --------------------------------------------------------------------------------------------------------


def _request(**headers: str) -> Request:
    return Request({"type": "http", "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]})


def test_our_key_may_ride_in_x_api_key_beside_vllms_bearer_key():
    keys = [b"ours"]
    require_key(_request(Authorization="Bearer vllms-key", **{"X-API-Key": "ours"}), keys)
    require_key(_request(Authorization="Bearer ours"), keys)
    for headers in [{"Authorization": "Bearer vllms-key"}, {"X-API-Key": ""}, {"Authorization": "Bearer "}, {}]:
        with pytest.raises(HTTPException, match="API key") as refused:
            require_key(_request(**headers), keys)
        assert refused.value.status_code == 401


# -- several engines -------------------------------------------------------------------------------------------------


def test_several_engines_are_refused_before_the_engine_starts():
    out = subprocess.run([VLLM_INTERP, "serve", "--enable-steering", "--data-parallel-size", "2"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert "vllm-interp features need one engine behind the API servers, but these flags start 2" in (out.stdout
                                                                                                      + out.stderr)
    assert "Traceback" not in out.stderr  # a flag the engine cannot run with is a usage error, not a crash
