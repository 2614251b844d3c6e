"""A `vllm-interp serve` killed while its filesystem consumer writes: every capture sent is complete, not begun,
or (exactly one) stopped at a step of its publish that reads as incomplete; nothing looks complete but is not."""

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import requests
from safetensors import safe_open

from tests.capture.test_filesystem import tree
from tests.conftest import HIDDEN, SERVER_ARGS, launch_server, stop_server
from vllm_interp.capture.consumers.filesystem import list_captures, read_capture

PROMPT_TOKENS = 400  # x 90 sites x 576 fp32: 83 MB per request, long enough to catch a write in flight
SITES = 90  # every hook of SmolLM2's 30 layers
COUNT = 6  # tags sent: kill/0 .. kill/5


def _send_captures(url: str, prompt: list[int], count: int) -> None:
    for i in range(count):
        body = {"prompt": prompt, "max_tokens": 1,
                "capture": {"filesystem": {"hooks": "all", "positions": "all_prompt", "tag": f"kill/{i}"}}}
        try:
            requests.post(f"{url}/v1/completions", json=body, timeout=120)
        except requests.RequestException:
            return  # the server is gone


def _names(tag: str) -> tuple[str, str, str, str]:
    """The data file, sidecar and their temps (random part as "*") a packed capture of ``tag`` writes."""
    directory, name = tag.rsplit("/", 1)
    return (f"{directory}/{name}.safetensors", f"{directory}/{name}.json",
            f"{directory}/.{name}.safetensors.*.tmp", f"{directory}/.{name}.json.*.tmp")


def _files_of(root: Path, tag: str) -> list[str]:
    """The entries under root that belong to ``tag``, sorted (a repeated temp would show twice)."""
    return [path for path in tree(root) if path in _names(tag)]


def _state(root: Path, tag: str) -> str:
    """"complete", "interrupted" or "untouched", after checking that the tag's files are exactly one of the
    states a packed write passes through (test_filesystem.py kills a writer at each step and checks each)."""
    data, sidecar, data_temp, sidecar_temp = _names(tag)
    files = _files_of(root, tag)
    if files == sorted([data, sidecar]):
        assert tag in list_captures(root)
        tensors, meta = read_capture(root, tag)
        assert meta["positions"] == list(range(PROMPT_TOKENS))
        assert len(tensors) == SITES and all(t.shape == (PROMPT_TOKENS, HIDDEN) for t in tensors.values())
        return "complete"
    if not files:
        return "untouched"
    # Killed writing or syncing the data, after publishing it, or writing or syncing the sidecar.
    assert files in ([data_temp], [data], sorted([data, sidecar_temp])), f"{tag} left {files}"
    assert tag not in list_captures(root)
    with pytest.raises(FileNotFoundError):
        read_capture(root, tag)
    if data in files:  # published data is whole even without its sidecar
        with safe_open(str(root / data), "pt") as handle:
            names = list(handle.keys())
            assert len(names) == SITES
            assert all(handle.get_slice(n).get_shape() == [PROMPT_TOKENS, HIDDEN] for n in names)
    return "interrupted"


def test_a_server_killed_mid_write_leaves_each_capture_complete_untouched_or_at_one_publish_step(
    smollm2_path, smollm2_tokenizer, tmp_path
):
    root = tmp_path / "captures"
    text = " ".join(f"Line {i} of the report lists a {['cat', 'dog', 'fox'][i % 3]}." for i in range(60))
    prompt = smollm2_tokenizer(text).input_ids[:PROMPT_TOKENS]
    url, process = launch_server(
        [*SERVER_ARGS, "--capture-consumers", f"filesystem:root={root},layout=packed"], tmp_path / "server.log"
    )
    sender = threading.Thread(target=_send_captures, args=(url, prompt, COUNT), daemon=True)
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

    # The sender waits for each response, which carries the capture result, so the consumer writes the tags one
    # at a time, in order: some complete, the one the kill cut short, and the rest not begun.
    states = [_state(root, f"kill/{i}") for i in range(COUNT)]
    assert "interrupted" in states, f"no write was interrupted: {states}"
    cut = states.index("interrupted")
    assert states == ["complete"] * cut + ["interrupted"] + ["untouched"] * (COUNT - cut - 1)
    assert list_captures(root) == [f"kill/{i}" for i in range(cut)]
    # Nothing under the root but the tags' own files.
    assert tree(root) == sorted(["kill/", *(path for i in range(COUNT) for path in _files_of(root, f"kill/{i}"))])
