"""`vllm-interp serve` on the default model: starts, hooks, answers /v1/completions."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

VLLM_INTERP = str(Path(sys.executable).with_name("vllm-interp"))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def server(smollm2_path):
    port = _free_port()
    # --enforce-eager: the compiled path is covered by the offline engines; this test is about the CLI.
    command = [
        VLLM_INTERP, "serve", "--enable-steering", "--dtype", "float32", "--enforce-eager", "--port", str(port),
        "--max-model-len", "512", "--kv-cache-memory-bytes", str(128 << 20), "--seed", "0",
    ]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=os.environ)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    try:
        while time.time() < deadline:
            if process.poll() is not None:
                pytest.fail(f"server exited with {process.returncode}:\n{process.stdout.read()[-4000:]}")
            try:
                if requests.get(f"{url}/health", timeout=2).ok:
                    break
            except requests.ConnectionError:
                pass
            time.sleep(2)
        else:
            pytest.fail("server did not become healthy in 600 s")
        yield url, process
    finally:
        process.terminate()
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()


def test_serve_answers_completions_on_the_default_model(server):
    url, _ = server
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="unused")
    model = client.models.list().data[0].id
    assert model.endswith("SmolLM2-135M-Instruct")
    completion = client.completions.create(model=model, prompt="The capital of France is", max_tokens=4,
                                           temperature=0)
    assert completion.choices[0].text.startswith(" Paris")


def test_serve_help_lists_our_flags():
    out = subprocess.run([VLLM_INTERP, "serve", "--help=vllm-interp"], capture_output=True, text=True, check=True)
    for flag in ("--enable-steering", "--enable-patching", "--capture-consumers"):
        assert flag in out.stdout
    top = subprocess.run([VLLM_INTERP, "--help"], capture_output=True, text=True, check=True).stdout
    for command in ("serve", "demo", "models"):
        assert command in top


def test_unknown_capture_consumer_is_refused_before_start():
    out = subprocess.run([VLLM_INTERP, "serve", "--capture-consumers", "nosuch:root=/tmp"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert "unknown consumer 'nosuch'" in out.stderr + out.stdout
