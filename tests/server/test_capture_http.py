"""Capture over HTTP on `vllm-interp serve`: the openai client's extra_body, results in the response (in the
last event of a streamed one), a third-party consumer installed from examples/, a global spec, and 400s that
name the field."""

import json
import time

import pytest
import requests
import torch

from vllm_interp.capture.consumers.filesystem import read_capture
from vllm_interp.capture.consumers.inline import ResidualReadout

PROMPT = "The capital of France is"


def _client(url):
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="unused")
    return client, client.models.list().data[0].id


def _stats_lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _metric_count(url: str, name: str) -> float:
    text = requests.get(f"{url}/metrics", timeout=30).text
    return sum(float(line.rpartition(" ")[2]) for line in text.splitlines() if line.startswith(f"{name}_count"))


def test_capture_results_come_back_with_the_completion(server, server_dirs):
    client, model = _client(server[0])
    waits = [_metric_count(server[0], f"vllm_interp:capture_results_{stage}_seconds") for stage in ("wait", "prepare")]
    hooks = {"post_block": [5, 20]}
    capture = {
        "inline": {"hooks": hooks, "positions": "all_prompt"},
        "filesystem": {"hooks": hooks, "positions": "all_prompt", "tag": "http/one"},
        "activation_stats": {"hooks": {"post_attn": [2]}, "positions": "last_prompt", "note": "from http"},
    }
    completion = client.completions.create(model=model, prompt=PROMPT, max_tokens=3, temperature=0,
                                           extra_body={"capture": capture})
    assert completion.choices[0].text.startswith(" Paris")
    results = completion.model_dump()["capture_results"]
    assert {name: r["status"] for name, r in results.items()} == dict.fromkeys(capture, "ok")

    readout = ResidualReadout.from_result(results["inline"]["result"])
    prompt_tokens = completion.usage.prompt_tokens
    assert readout.positions == list(range(prompt_tokens))
    assert readout.sites == ["5.post_block", "20.post_block"] and readout["5.post_block"].shape == (prompt_tokens, 576)
    tensors, meta = read_capture(server_dirs["captures"], "http/one")
    assert meta["positions"] == readout.positions
    for name, tensor in tensors.items():
        torch.testing.assert_close(tensor, readout[name], rtol=0, atol=0)
    # The wait for the results is on /metrics beside vLLM's own.
    assert [_metric_count(server[0], f"vllm_interp:capture_results_{stage}_seconds")
            for stage in ("wait", "prepare")] == [count + 1 for count in waits]

    # The third-party consumer: the request's own spec replaces the server's global one for that consumer.
    (line,) = [line for line in _stats_lines(server_dirs["stats"]) if line["note"] == "from http"]
    assert list(line["mean_norm"]) == ["2.post_attn"] and line["positions"] == [prompt_tokens - 1]
    assert results["activation_stats"]["result"]["sites"] == 1


def test_chat_completions_carry_results_too(server):
    client, model = _client(server[0])
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hi"}], max_tokens=2, temperature=0,
        extra_body={"capture": {"inline": {"hooks": {"pre_attn": [0]}, "positions": "last_prompt"}}},
    )
    result = chat.model_dump()["capture_results"]["inline"]
    assert result["status"] == "ok"
    assert ResidualReadout.from_result(result["result"]).positions == [chat.usage.prompt_tokens - 1]


def test_global_capture_sees_requests_without_a_capture_field(server, server_dirs):
    client, model = _client(server[0])
    completion = client.completions.create(model=model, prompt="Two plus two is", max_tokens=2, temperature=0)
    assert "capture_results" not in completion.model_dump()
    # The consumer's line carries the engine's request id: vLLM's completion id plus the prompt's index.
    request_id = f"{completion.id}-0"
    deadline = time.time() + 30
    while not (lines := [line for line in _stats_lines(server_dirs["stats"]) if line["request_id"] == request_id]):
        assert time.time() < deadline, f"the global spec never captured {request_id}"
        time.sleep(0.2)
    (line,) = lines
    assert list(line["mean_norm"]) == ["3.post_block"] and line["note"] is None
    assert line["positions"] == [completion.usage.prompt_tokens - 1] and line["mean_norm"]["3.post_block"] > 0


def test_streamed_requests_reach_file_consumers(server, server_dirs):
    client, model = _client(server[0])
    stream = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=3, temperature=0, stream=True,
        extra_body={"capture": {"filesystem": {"hooks": {"post_block": [1]}, "tag": "http/streamed"}}},
    )
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices).startswith(" Paris")
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            tensors, _ = read_capture(server_dirs["captures"], "http/streamed")
            break
        except FileNotFoundError:
            time.sleep(0.2)
    else:
        pytest.fail("the streamed request's capture was never published")
    assert tensors["1.post_block"].shape == (1, 576)


def _stream(url: str, path: str, body: dict) -> list[dict]:
    """The chunks of a streamed request, after checking that the stream ends with [DONE]."""
    with requests.post(f"{url}{path}", json={**body, "stream": True}, stream=True, timeout=300) as reply:
        assert reply.status_code == 200, reply.text
        events = reply.content.decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""] and all(e.startswith("data: ") for e in events[:-2])
    return [json.loads(e.removeprefix("data: ")) for e in events[:-2]]


# Per path: the prompt, a streamed choice's text, a whole response's choice's text.
STREAMED = {
    "/v1/completions": ({"prompt": PROMPT}, lambda c: c["text"], lambda c: c["text"]),
    "/v1/chat/completions": ({"messages": [{"role": "user", "content": "Say hi"}]},
                             lambda c: c["delta"].get("content") or "", lambda c: c["message"]["content"]),
}


@pytest.mark.parametrize(("include_usage", "positions"), [(False, "all"), (True, "all"), (False, "all_prompt")])
@pytest.mark.parametrize("path", list(STREAMED))
def test_streamed_responses_carry_results_in_their_last_event(server, path, include_usage, positions):
    """``all_prompt``: results whole once the prompt has run, which the stream asks for at its first event."""
    url, _ = server
    _, model = _client(url)
    prompt, streamed_text, whole_text = STREAMED[path]
    base = {"model": model, **prompt, "max_tokens": 4, "temperature": 0}
    capture = {"capture": {"inline": {"hooks": {"pre_attn": [0], "post_block": [5]}, "positions": positions}}}
    options = {"stream_options": {"include_usage": True}} if include_usage else {}
    whole = requests.post(f"{url}{path}", json={**base, **capture}, timeout=300).json()
    chunks = _stream(url, path, {**base, **capture, **options})
    *head, last = chunks

    # The client gets the events plain vLLM sends it (no usage chunk unless it asked), the last one with results.
    assert [_shape(c) for c in chunks] == [_shape(c) for c in _stream(url, path, {**base, **options})]
    assert all("capture_results" not in c for c in head)
    assert any("usage" in c for c in chunks) == include_usage
    assert last.get("system_fingerprint") == whole.get("system_fingerprint")
    if include_usage:
        assert last["choices"] == [] and _counts(last["usage"]) == _counts(whole["usage"])
    assert "".join(streamed_text(choice) for c in chunks for choice in c["choices"]) == whole_text(whole["choices"][0])

    streamed, reference = (ResidualReadout.from_result(r["capture_results"]["inline"]["result"]) for r in (last, whole))
    assert last["capture_results"]["inline"]["status"] == "ok"
    length = whole["usage"]["prompt_tokens"] + whole["usage"]["completion_tokens"]
    if positions == "all":
        length -= 1  # the last token is never fed back
    else:
        length = whole["usage"]["prompt_tokens"]
    assert streamed.positions == reference.positions == list(range(length))
    assert streamed.sites == reference.sites == ["0.pre_attn", "5.post_block"]
    for site in reference.sites:
        torch.testing.assert_close(streamed[site], reference[site], rtol=0, atol=0)


def _shape(chunk: dict) -> dict:
    """A chunk without what differs between two runs (id, time) and the capture results."""
    return {k: v for k, v in chunk.items() if k not in ("id", "created", "capture_results")}


def _counts(usage: dict) -> tuple[int, int]:
    return usage["prompt_tokens"], usage["completion_tokens"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"capture": {"inline": {"hooks": {"post_block": [30]}}}}, "capture.inline.hooks.post_block"),
        ({"capture": {"nosuch": {}}}, "capture.nosuch"),
        ({"capture": {"filesystem": {"tag": "../../etc"}}}, "capture.filesystem.tag"),
        ({"capture": {"filesystem": {"layout": "zip"}}}, "capture.filesystem.layout"),
        ({"capture": {"activation_stats": {"note": 3}}}, "capture.activation_stats.note"),
        ({"capture": {"inline": {}}, "n": 2}, "capture"),
        ({"capture": {"inline": {}}, "prompt": [PROMPT, "Two prompts"]}, "capture"),
        ({"capture": {"inline": {"hooks": {"hook_resid_post": [1], "post_block": [2]}}}},
         "capture.inline.hooks.post_block"),
        ({"capture": {"inline": {"hooks": ["blocks.1.hook_mlp_out"]}}}, "capture.inline.hooks.0"),
        ({"capture": {"inline": {"naming": "tl"}}}, "capture.inline.naming"),
        ({"capture": {"sae_features": {"hooks": {"post_block": [3]}}}}, "capture.sae_features.hooks"),
        ({"capture": "all"}, "capture"),
    ],
)
def test_bad_capture_specs_get_400_naming_the_field(server, body, param):
    url, _ = server
    reply = requests.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 1, **body}, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["message"].startswith(param)
