"""The `vllm-interp serve` process shared by the HTTP tests: default model, steering on, an API key, a
named vector loaded at start-up."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import requests

VLLM_INTERP = str(Path(sys.executable).with_name("vllm-interp"))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


API_KEY = "test-steering-key"
HIDDEN = 576


def vector(seed: int, norm: float = 8.0) -> list[float]:
    v = np.random.default_rng(seed).standard_normal(HIDDEN).astype(np.float32)
    return (v / np.linalg.norm(v) * norm).tolist()


@pytest.fixture(scope="package")
def server(smollm2_path, tmp_path_factory):
    port = _free_port()
    named = tmp_path_factory.mktemp("vectors") / "formal.json"
    named.write_text(json.dumps({"vectors": {"post_block": {"6": vector(42)}}}))
    # --enforce-eager: the compiled path is covered by the offline engines; this test is about the CLI.
    command = [
        VLLM_INTERP, "serve", "--enable-steering", "--dtype", "float32", "--enforce-eager", "--port", str(port),
        "--max-model-len", "512", "--kv-cache-memory-bytes", str(128 << 20), "--seed", "0",
        "--steering-api-key", API_KEY, "--steering-vectors", f"formal={named}", "--max-steering-configs", "2",
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
