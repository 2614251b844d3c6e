"""The front doors refuse what vllm-interp cannot serve, clearly: another vLLM release (`vllm-interp serve`
and `vllm_interp.LLM`) and an architecture without decoder layers (`vllm-interp serve`) before any engine
starts; bad steering or capture fields on /v1/chat/completions and bad /v1/steering/vectors/* bodies with a
400 naming the field, after which the engine still serves."""

import json
import os
import signal
import subprocess
import sys

import pytest
import requests
import transformers

from tests.conftest import API_KEY, SERVER_ARGS, VLLM_INTERP, vector
from tests.server.test_steering_http import BAD as BAD_STEERING_FIELDS
from vllm_interp.engine.versions import UnsupportedVllmVersion, check_vllm_version
from vllm_interp.models.registry import unsupported_message

AUTH = {"Authorization": f"Bearer {API_KEY}"}
# vLLM's engine core process tags every line it logs with this; a refusal comes before the process exists.
ENGINE_MARK = "EngineCore"
OTHER_VLLM = "0.27.0"


def _run(argv: list[str], timeout: float = 300) -> tuple[int, str]:
    """Exit status and output of a front door run in its own process group. A door that fails to refuse
    goes on to serve: after ``timeout`` the whole group is killed and the test fails."""
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        pytest.fail(f"{argv} did not refuse within {timeout} s")
    return process.returncode, output


def _with_other_vllm(code: str) -> list[str]:
    """A fresh interpreter in which the installed vLLM reports another release, then runs ``code``."""
    return [sys.executable, "-c", f"import vllm\nvllm.__version__ = {OTHER_VLLM!r}\n{code}"]


@pytest.fixture(scope="module")
def version_message() -> str:
    with pytest.raises(UnsupportedVllmVersion) as refused:
        check_vllm_version(OTHER_VLLM)
    return str(refused.value)


def test_serve_refuses_another_vllm_release_with_a_clean_error(smollm2_path, version_message):
    argv = ["serve", str(smollm2_path), "--enable-steering", *SERVER_ARGS]
    status, output = _run(_with_other_vllm(f"from vllm_interp.cli import main\nmain({argv!r})"))
    assert status == 1, output[-4000:]
    assert f"error: {version_message}" in output
    assert "Traceback" not in output and ENGINE_MARK not in output, output[-4000:]


LLM_DOOR = """
import json, psutil
from vllm_interp import LLM
from vllm_interp.engine.versions import UnsupportedVllmVersion
try:
    LLM({model!r}, enable_steering=True, dtype="float32", max_model_len=512, kv_cache_memory_bytes=128 << 20)
except UnsupportedVllmVersion as exc:
    print(json.dumps({{"refused": str(exc), "children": len(psutil.Process().children(recursive=True))}}))
"""


def test_llm_refuses_another_vllm_release_before_an_engine_starts(smollm2_path, version_message):
    status, output = _run(_with_other_vllm(LLM_DOOR.format(model=str(smollm2_path))))
    assert status == 0, output[-4000:]
    lines = [line for line in output.splitlines() if line.startswith('{"refused"')]
    assert lines, f"vllm_interp.LLM did not refuse:\n{output[-4000:]}"
    assert json.loads(lines[-1]) == {"refused": version_message, "children": 0}
    assert ENGINE_MARK not in output


@pytest.fixture(scope="module")
def encoder_checkpoint(tmp_path_factory):
    """A real (tiny, random-weight) BERT masked-LM checkpoint: an encoder, nothing to hook."""
    path = tmp_path_factory.mktemp("bert")
    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=64, vocab_size=128)
    transformers.BertForMaskedLM(config).save_pretrained(path)
    return path


@pytest.mark.parametrize("model_impl", ["auto", "transformers"])
def test_serve_refuses_an_encoder_before_an_engine_starts(encoder_checkpoint, model_impl):
    status, output = _run([VLLM_INTERP, "serve", str(encoder_checkpoint), "--enable-steering",
                           "--model-impl", model_impl, *SERVER_ARGS])
    assert status != 0
    assert unsupported_message("BertForMaskedLM") in output, output[-4000:]
    assert ENGINE_MARK not in output and "Traceback" not in output, output[-4000:]


@pytest.fixture(scope="module")
def model_id(server) -> str:
    return requests.get(f"{server[0]}/v1/models").json()["data"][0]["id"]


def _chat(url: str, model: str, **fields) -> requests.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 2,
            "temperature": 0, **fields}
    # json.dumps writes NaN as the literal NaN, which the server's parser accepts: the check must catch it.
    return requests.post(f"{url}/v1/chat/completions", data=json.dumps(body),
                         headers={"Content-Type": "application/json"}, timeout=120)


def _still_serves(url: str, model: str) -> None:
    reply = _chat(url, model)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"]


# The steering cases are those of /v1/completions (one middleware serves both doors); the capture cases
# differ from the completions ones so that together they cover more of the spec.
BAD_CHAT_FIELDS = [
    *BAD_STEERING_FIELDS,
    ({"capture": {"inline": {"positions": [-1]}}}, "capture.inline.positions"),
    ({"capture": {"inline": {"hooks": {"mlp_out": [1]}}}}, "capture.inline.hooks.mlp_out"),
    ({"capture": {"filesystem": {"hooks": {}}}}, "capture.filesystem.hooks"),
    # Sampled, since vLLM itself refuses n > 1 with greedy sampling.
    ({"capture": {"inline": {"hooks": {"post_block": [3]}}}, "n": 2, "temperature": 1.0}, "capture"),
    ({"capture": ["inline"]}, "capture"),
]


@pytest.mark.parametrize(("fields", "param"), BAD_CHAT_FIELDS, ids=[p for _, p in BAD_CHAT_FIELDS])
def test_chat_completions_answer_bad_fields_with_400_naming_the_field(server, model_id, fields, param):
    url, _ = server
    reply = _chat(url, model_id, **fields)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["message"].startswith(param), error
    _still_serves(url, model_id)


GOOD = {"post_block": {"2": vector(8)}}
BAD_BODIES = [
    pytest.param("vectors/register", b"not json", "body", id="register-not-json"),
    pytest.param("vectors/register", [{"name": "x", "vectors": GOOD}], "body", id="register-not-an-object"),
    pytest.param("vectors/register", {"vectors": GOOD}, "name", id="register-missing-name"),
    pytest.param("vectors/register", {"name": "", "vectors": GOOD}, "name", id="register-empty-name"),
    pytest.param("vectors/register", {"name": 3, "vectors": GOOD}, "name", id="register-name-not-a-string"),
    pytest.param("vectors/register", {"name": "x"}, "vectors", id="register-no-vectors"),
    pytest.param("vectors/register", {"name": "x", "vectors": {}}, "vectors", id="register-empty-vectors"),
    pytest.param("vectors/register", {"name": "x", "vectors": {"post_block": {"2": [1.0, 2.0]}}},
                 "vectors.post_block.2", id="register-wrong-length"),
    pytest.param("vectors/register", {"name": "x", "prefill_vectors": {"mlp_out": {"2": vector(8)}}},
                 "prefill_vectors.mlp_out", id="register-unknown-hook"),
    pytest.param("vectors/register", {"name": "x", "decode_vectors": {"post_block": {"30": vector(8)}}},
                 "decode_vectors.post_block.30", id="register-layer-out-of-range"),
    pytest.param("vectors/register", {"name": "x", "vector": GOOD}, "vector", id="register-unknown-field"),
    pytest.param("vectors/unregister", {"name": "nosuch"}, "name", id="unregister-unknown-name"),
    pytest.param("vectors/unregister", None, "body", id="unregister-no-body"),
]


@pytest.mark.parametrize(("endpoint", "body", "param"), BAD_BODIES)
def test_bad_named_vector_bodies_get_400_naming_the_field(server, model_id, endpoint, body, param):
    url, _ = server
    before = requests.get(f"{url}/v1/steering/vectors").json()
    target = f"{url}/v1/steering/{endpoint}"
    if isinstance(body, bytes):
        reply = requests.post(target, data=body, headers={**AUTH, "Content-Type": "application/json"}, timeout=60)
    else:
        reply = requests.post(target, json=body, headers=AUTH, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["message"].startswith(param), error
    assert requests.get(f"{url}/v1/steering/vectors").json() == before
    _still_serves(url, model_id)
