"""`POST /v1/patch_sweep` on `vllm-interp serve`: the grid equals the same cells sent one by one, streaming
sends start / cell / summary events, unequal prompts are aligned loudly, bad bodies get 400s, and a source
deleted mid-sweep fails the cells it has not patched yet."""

import json

import pytest
import requests

CLEAN, CORRUPT = "The capital of France is", "The capital of Italy is"


def _sweep(url: str, **body) -> requests.Response:
    base = {"prompt": CORRUPT, "clean_prompt": CLEAN, "hooks": ["pre_attn", "post_block"], "layers": [0, 6, 12],
            "answer_token": " Paris", "foil_token": " Rome", "metric": "logit_diff"}
    return requests.post(f"{url}/v1/patch_sweep", json={**base, **body}, timeout=300)


def test_a_sweep_equals_its_cells_sent_one_by_one(server):
    url, _ = server
    reply = _sweep(url)
    assert reply.status_code == 200, reply.text
    out = reply.json()
    assert out["layers"] == [0, 6, 12] and out["positions"] == [0, 1, 2, 3, 4]
    assert out["tokens"] == ["The", "Ġcapital", "Ġof", "ĠItaly", "Ġis"] and out["skipped"] == []
    assert not out["errors"] and out["alignment"]["kind"] == "identity"
    assert out["noise_floor"]["answer_logprob"] < 1e-3
    # Patching the differing token at layer 0 restores the clean answer; earlier tokens change nothing.
    grid = out["grids"]["pre_attn"]
    assert grid["answer_logprob"][0][3] == pytest.approx(out["clean"]["answer_logprob"], abs=1e-4)
    assert grid["answer_logprob"][0][0] == pytest.approx(out["corrupt"]["answer_logprob"], abs=1e-4)
    # One cell as a plain patched completion (its source: a clean run captured the same way).
    requests.post(f"{url}/v1/completions", json={"prompt": CLEAN, "max_tokens": 1, "capture": {
        "patch_source": {"hooks": {"post_block": [6]}, "positions": "all_prompt", "tag": "sweep-check"}}}, timeout=60)
    cell = requests.post(f"{url}/v1/completions", json={
        "prompt": CORRUPT, "max_tokens": 1, "temperature": 0, "logprobs": 20,
        "patch": [{"layer": 6, "hook": "post_block", "position": 3, "source": {"run": "sweep-check", "position": 3}}],
    }, timeout=60).json()
    top = cell["choices"][0]["logprobs"]["top_logprobs"][0]
    assert out["grids"]["post_block"]["answer_logprob"][1][3] == pytest.approx(top[" Paris"], abs=1e-4)
    # The sweep's own clean run is gone afterwards.
    runs = [run["run_id"] for run in requests.get(f"{url}/v1/patch_sources").json()["runs"]]
    assert not any(run.startswith("sweep-") and run != "sweep-check" for run in runs)


def test_streaming_sends_start_cells_and_summary(server):
    url, _ = server
    with requests.post(f"{url}/v1/patch_sweep", json={
        "prompt": CORRUPT, "clean_prompt": CLEAN, "hook": "post_block", "layers": {"start": 0, "stop": 30,
                                                                                  "step": 10},
        "positions": {"span": "Italy"}, "answer_token": " Paris", "metric": "logprob", "stream": True,
    }, stream=True, timeout=300) as reply:
        assert reply.status_code == 200
        events, kind = [], None
        for line in reply.iter_lines(decode_unicode=True):
            if line.startswith("event:"):
                kind = line.split(":", 1)[1].strip()
            elif line.startswith("data:"):
                events.append((kind, json.loads(line.split(":", 1)[1])))
    kinds = [k for k, _ in events]
    assert kinds[0] == "start" and kinds[-1] == "summary" and kinds.count("cell") == 3
    assert events[0][1]["positions"] == [3] and events[-1][1]["layers"] == [0, 10, 20]


def test_unequal_prompts_skip_the_differing_middle_loudly(server):
    url, _ = server
    reply = _sweep(url, prompt="The capital of the United Kingdom is", layers=[0])
    assert reply.status_code == 200, reply.text
    out = reply.json()
    assert out["alignment"]["kind"] == "prefix_suffix" and out["alignment"]["common_prefix"] == 3
    assert [s["position"] for s in out["skipped"]] == [3, 4, 5]
    assert out["positions"] == [0, 1, 2, 6]


BAD = [
    ({"answer_token": " Par is"}, "answer_token"),
    ({"layers": [30]}, "layers"),
    ({"hooks": ["mlp_out"]}, "hooks.0"),
    ({"source_run": "x"}, "clean_prompt"),
    ({"positions": {"span": "Spain"}}, "positions.span"),
    ({"metric": "logit_diff", "foil_token": None}, "metric"),
    ({"layers": "all", "hooks": ["pre_attn", "post_attn", "post_block"], "positions": "all_prompt",
      "prompt": "word " * 60, "clean_prompt": "term " * 60}, "layers"),
]


@pytest.mark.parametrize(("body", "param"), BAD, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD)])
def test_bad_sweeps_get_400_naming_the_field(server, body, param):
    url, _ = server
    reply = _sweep(url, **body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


def test_a_source_deleted_during_a_sweep_fails_the_cells_left_never_patches_them_wrongly(open_server):
    url = open_server
    # Every hook: 450 cells, admitted two at a time (the server's --max-num-seqs), so that many still wait when
    # the delete lands after the first cell's event (usually all but a few; one CI run with 150 cells saw none
    # fail, for a reason not found: more cells widen the margin).
    def capture_clean(tag: str) -> None:
        capture = {"patch_source": {"hooks": "all", "positions": "all_prompt", "tag": tag}}
        assert requests.post(f"{url}/v1/completions", json={"prompt": CLEAN, "max_tokens": 1, "capture": capture},
                             timeout=60).ok

    capture_clean("doomed")
    hooks = ["pre_attn", "post_attn", "post_block"]
    body = {"prompt": CORRUPT, "source_run": "doomed", "hooks": hooks, "answer_token": " Paris", "metric": "logprob"}
    cells, deleted = [], False
    with requests.post(f"{url}/v1/patch_sweep", json={**body, "stream": True}, stream=True, timeout=300) as reply:
        kind = None
        for line in reply.iter_lines(decode_unicode=True):
            if line.startswith("event:"):
                kind = line.split(":", 1)[1].strip()
            elif line.startswith("data:") and kind == "cell":
                cells.append(json.loads(line.split(":", 1)[1]))
                if not deleted:
                    assert requests.delete(f"{url}/v1/patch_sources/doomed", timeout=60).status_code == 200
                    deleted = True
    assert len(cells) == 3 * 150
    failed = [c for c in cells if "error" in c]
    assert failed and all("no longer holds" in c["error"] for c in failed)
    # Every cell that ran has the value it has with the run in place: the same cells swept from the same clean
    # run captured again (the grid spanning them, not all 450: a whole grid's sweep is about a minute of CI).
    patched = [c for c in cells if "error" not in c]
    assert "error" not in cells[0]  # it ran before the delete
    capture_clean("kept")
    span = {"hooks": sorted({c["hook"] for c in patched}), "layers": sorted({c["layer"] for c in patched}),
            "positions": sorted({c["position"] for c in patched})}
    reference = requests.post(f"{url}/v1/patch_sweep", json={**body, **span, "source_run": "kept"},
                              timeout=300).json()
    for cell in patched:
        value = reference["grids"][cell["hook"]]["answer_logprob"][
            reference["layers"].index(cell["layer"])][reference["positions"].index(cell["position"])]
        assert cell["answer_logprob"] == pytest.approx(value, abs=1e-5)
