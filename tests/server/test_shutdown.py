"""A `vllm-interp serve` stopped with SIGTERM publishes what its consumers buffered: the sharded layout's last
shard, not yet full, is on disk and indexed afterwards (vLLM's default shutdown would kill the engine's process
tree, consumer processes included, before they close)."""

import requests

from tests.conftest import HIDDEN, SERVER_ARGS, launch_server, stop_server
from vllm_interp.capture.consumers.filesystem import list_captures, read_capture

PROMPT = [1, 504, 3412, 314, 260, 1345, 282]
LAYERS = [1, 2]


def test_a_stopped_server_publishes_the_last_buffered_shard(smollm2_path, tmp_path):
    root = tmp_path / "captures"
    log = tmp_path / "server.log"
    url, process = launch_server(
        [*SERVER_ARGS, "--capture-consumers", f"filesystem:root={root},layout=sharded,shard_mb=64"], log
    )
    try:
        for i in range(2):
            body = {"prompt": PROMPT, "max_tokens": 2,
                    "capture": {"filesystem": {"hooks": {"post_block": LAYERS}, "positions": "all", "tag": f"t{i}"}}}
            result = requests.post(f"{url}/v1/completions", json=body, timeout=120).json()["capture_results"]
            assert result["filesystem"]["result"]["pending"] is True  # buffered: the shard is far from full
        assert list_captures(root) == []
    finally:
        stop_server(process)  # SIGTERM, as a process manager stops a server
    # What the server did when stopped (vLLM's list of routes left out: it fills the tail).
    shutdown_log = "\n".join([line for line in log.read_text().splitlines() if "Route:" not in line][-40:])
    assert process.returncode == 0, shutdown_log
    assert list_captures(root) == ["t0", "t1"], shutdown_log
    for tag in ("t0", "t1"):
        tensors, meta = read_capture(root, tag)
        assert meta["positions"] == list(range(len(PROMPT) + 1))
        assert sorted(tensors) == [f"{layer}.post_block" for layer in LAYERS]
        assert all(t.shape == (len(PROMPT) + 1, HIDDEN) for t in tensors.values())
