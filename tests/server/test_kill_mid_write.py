"""A `vllm-interp serve` killed while its filesystem consumer writes leaves no capture that looks complete
but is not."""

import os
import signal
import threading
import time

import requests
from safetensors import safe_open

from tests.conftest import SERVER_ARGS, launch_server, stop_server
from vllm_interp.capture.consumers.filesystem import list_captures, read_capture

PROMPT_TOKENS = 400  # x 90 sites x 576 fp32: 83 MB per request, long enough to catch a write in flight


def _send_captures(url: str, prompt: list[int], count: int) -> None:
    for i in range(count):
        body = {"prompt": prompt, "max_tokens": 1,
                "capture": {"filesystem": {"hooks": "all", "positions": "all_prompt", "tag": f"kill/{i}"}}}
        try:
            requests.post(f"{url}/v1/completions", json=body, timeout=120)
        except requests.RequestException:
            return  # the server is gone


def test_a_server_killed_mid_write_leaves_only_complete_captures_or_hidden_temps(
    smollm2_path, smollm2_tokenizer, tmp_path
):
    root = tmp_path / "captures"
    text = " ".join(f"Line {i} of the report lists a {['cat', 'dog', 'fox'][i % 3]}." for i in range(60))
    prompt = smollm2_tokenizer(text).input_ids[:PROMPT_TOKENS]
    url, process = launch_server(
        [*SERVER_ARGS, "--capture-consumers", f"filesystem:root={root},layout=packed"], tmp_path / "server.log"
    )
    sender = threading.Thread(target=_send_captures, args=(url, prompt, 6), daemon=True)
    sender.start()
    caught_in_flight = False
    try:
        deadline = time.time() + 300
        while time.time() < deadline and sender.is_alive():
            if any(root.rglob(".*.tmp")):
                caught_in_flight = True
                break
            time.sleep(0.002)
        # Every process of the server at once (API server, engine core, worker with the consumer thread).
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(60)
    finally:
        if process.poll() is None:
            stop_server(process)
    sender.join(30)
    assert caught_in_flight, "no write was in flight to interrupt"

    complete = list_captures(root)
    for base in complete:  # a sidecar means complete data
        tensors, meta = read_capture(root, base)
        assert len(tensors) == 90 and all(t.shape == (PROMPT_TOKENS, 576) for t in tensors.values())
    visible = [p for p in root.rglob("*") if p.is_file() and not p.name.startswith(".")]
    for path in visible:
        if path.suffix == ".safetensors":  # published data opens whole, sidecar or not
            with safe_open(str(path), "pt") as handle:
                assert len(list(handle.keys())) == 90
    leftovers = [p for p in root.rglob("*") if p.is_file() and p.name.startswith(".")]
    assert all(p.name.endswith(".tmp") for p in leftovers)
    assert leftovers or len(complete) == len([p for p in visible if p.suffix == ".json"])
