"""Patching over HTTP on `vllm-interp serve`: a source run captured through ``capture``, the ``patch`` field
on completions and chat completions, /v1/patch_sources, and 400s that name the field."""

import pytest
import requests

from tests.conftest import API_KEY

PROMPT = "The capital of France is"
CORRUPT = "The capital of Italy is"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _post(url: str, path: str = "/v1/completions", **body):
    return requests.post(f"{url}{path}", json={"max_tokens": 2, "temperature": 0, "logprobs": 1, **body}, timeout=120)


def _cell(position: int, source: dict, layer: int = 2, hook: str = "post_block") -> dict:
    return {"layer": layer, "hook": hook, "position": position, "source": source}


@pytest.fixture(scope="module")
def clean_run(server):
    url, _ = server
    reply = _post(url, prompt=PROMPT, capture={"patch_source": {"hooks": "all", "positions": "all_prompt",
                                                                "tag": "http-clean"}})
    assert reply.status_code == 200, reply.text
    result = reply.json()["capture_results"]["patch_source"]
    assert result["status"] == "ok" and result["result"]["run_id"] == "http-clean"
    return reply.json()


def test_patching_every_position_from_the_clean_run_gives_the_clean_completion(server, clean_run):
    url, _ = server
    n = clean_run["usage"]["prompt_tokens"]
    patch = [_cell(p, {"run": "http-clean", "position": p}, layer=0, hook="pre_attn") for p in range(n)]
    patched = _post(url, prompt=CORRUPT, patch=patch)
    assert patched.status_code == 200, patched.text
    choice, clean = patched.json()["choices"][0], clean_run["choices"][0]
    assert choice["text"] == clean["text"]
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(clean["logprobs"]["token_logprobs"], abs=1e-5)
    assert "capture_results" not in patched.json()
    plain = _post(url, prompt=CORRUPT).json()["choices"][0]
    assert plain["text"] != clean["text"] or plain["logprobs"]["token_logprobs"] != choice["logprobs"]["token_logprobs"]


def test_chat_completions_take_the_patch_field(server, clean_run):
    url, _ = server
    messages = [{"role": "user", "content": "Say hi"}]
    reply = _post(url, "/v1/chat/completions", messages=messages, patch=[_cell(1, {"zeros": True})])
    assert reply.status_code == 200, reply.text
    media = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]
    reply = _post(url, "/v1/chat/completions", messages=media, patch=[_cell(1, {"zeros": True})])
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "patch"


def test_sources_are_listed_and_deleting_needs_the_key(server, clean_run):
    url, _ = server
    _post(url, prompt=PROMPT, capture={"patch_source": {"hooks": {"post_block": [3]}, "tag": "http-doomed"}})
    runs = {run["run_id"]: run for run in requests.get(f"{url}/v1/patch_sources").json()["runs"]}
    assert len(runs["http-clean"]["sites"]) == 90 and runs["http-clean"]["positions"] == list(range(5))
    assert runs["http-doomed"]["sites"] == ["3.post_block"]
    assert requests.delete(f"{url}/v1/patch_sources/http-doomed").status_code == 401
    assert requests.delete(f"{url}/v1/patch_sources/http-doomed", headers=AUTH).status_code == 200
    assert requests.delete(f"{url}/v1/patch_sources/http-doomed", headers=AUTH).status_code == 404
    reply = _post(url, prompt=CORRUPT, patch=[_cell(0, {"run": "http-doomed", "position": 0}, layer=3)])
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "patch.0.source.run"


def test_a_patch_the_worker_cannot_apply_is_an_error_not_a_completion(server):
    url, _ = server
    reply = _post(url, prompt=CORRUPT, patch=[_cell(50, {"zeros": True})])
    assert reply.status_code == 409, reply.text
    assert "not a prompt position" in reply.json()["error"]["message"]
    assert _post(url, prompt=PROMPT).status_code == 200


BAD = [
    ({"patch": {"layer": 1}}, "patch"),
    ({"patch": [{"hook": "post_block", "position": 0, "source": {"zeros": True}}]}, "patch.0.layer"),
    ({"patch": [_cell(0, {"zeros": True}, layer=30)]}, "patch.0.layer"),
    ({"patch": [_cell(0, {"zeros": True}, hook="mlp_out")]}, "patch.0.hook"),
    ({"patch": [{**_cell(0, {"zeros": True}), "alpha": 2}]}, "patch.0.alpha"),
    ({"patch": [_cell(0, {"zeros": True, "vector": [0.0]})]}, "patch.0.source"),
    ({"patch": [_cell(0, {"vector": [0.0, 1.0]})]}, "patch.0.source.vector"),
    ({"patch": [_cell(0, {"run": "nosuch", "position": 0})]}, "patch.0.source.run"),
    ({"patch": [_cell(0, {"zeros": True}), _cell(0, {"zeros": True})]}, "patch.1"),
    ({"patch": [_cell(0, {"zeros": True})], "stream": True}, "patch"),
    ({"patch": [_cell(0, {"zeros": True})], "n": 2}, "patch"),
    ({"patch": [{"site": "blocks.2.hook_resid_post", "layer": 2, "position": 0, "source": {"zeros": True}}]},
     "patch.0.site"),
    ({"patch": [{"site": "blocks.2.mlp_out", "position": 0, "source": {"zeros": True}}]}, "patch.0.site"),
]


def test_a_patch_on_several_prompts_is_refused(server):
    url, _ = server
    reply = requests.post(f"{url}/v1/completions", json={"prompt": [PROMPT, PROMPT], "max_tokens": 1,
                                                          "patch": [_cell(0, {"zeros": True})]}, timeout=60)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "patch", reply.text


@pytest.mark.parametrize(("body", "param"), BAD, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD)])
def test_bad_patch_specs_get_400_naming_the_field(server, body, param):
    url, _ = server
    reply = _post(url, prompt=PROMPT, **body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param
