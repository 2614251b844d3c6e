"""Several API servers in front of one engine (``--api-server-count 2``) share the global and named steering
vectors: a change made through whichever server took it is what every request sees, whichever server takes
that request (vllm_interp/server/shared_steering.py)."""

import json
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import psutil
import pytest
import requests

from tests.conftest import SERVER_ARGS, launch_server, stop_server, vector

STREAMS = 12
WAVES = 4


@pytest.fixture(scope="module")
def two_api_servers(smollm2_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("api-servers") / "server.log"
    url, process = launch_server([*SERVER_ARGS, "--enable-steering", "--api-server-count", "2"], log)
    try:
        yield url, process
    finally:
        stop_server(process)


def _listeners(process, port: int) -> list[psutil.Process]:
    """The processes ``vllm-interp serve`` started that accept connections on ``port``: its API servers (it
    holds the listening socket too, but serves nothing)."""
    found = []
    for candidate in psutil.Process(process.pid).children(recursive=True):
        try:
            if any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in candidate.net_connections("tcp")):
                found.append(candidate)
        except psutil.NoSuchProcess:
            continue
    return found


def _streamed(url: str, body: dict) -> tuple[int, str]:
    """One streamed completion on a connection of its own: status and text."""
    with requests.post(f"{url}/v1/completions", json={**body, "stream": True}, stream=True, timeout=300,
                       headers={"Connection": "close"}) as response:
        if response.status_code != 200:
            return response.status_code, response.text
        text = ""
        for line in response.iter_lines():
            if line.startswith(b"data: {"):
                text += json.loads(line[len(b"data: "):])["choices"][0]["text"]
        return 200, text


def _wave_of_streams(url: str, body: dict, servers: list[psutil.Process], port: int,
                     results: list[tuple[int, str]]) -> set[int]:
    """``STREAMS`` concurrent streams; appends their results and returns the pids of the servers seen holding one
    while they ran."""
    held = set()
    with ThreadPoolExecutor(STREAMS) as pool:
        futures = [pool.submit(_streamed, url, body) for _ in range(STREAMS)]
        while not all(f.done() for f in futures) and len(held) < 2:
            for server in servers:
                if any(c.status == psutil.CONN_ESTABLISHED and c.laddr.port == port
                       for c in server.net_connections("tcp")):
                    held.add(server.pid)
            time.sleep(0.05)
        results.extend(f.result() for f in futures)
    return held


def test_every_api_server_sees_vectors_registered_and_set_through_another(two_api_servers):
    url, process = two_api_servers
    port = urlparse(url).port
    servers = _listeners(process, port)
    assert len(servers) == 2, [s.name() for s in servers]

    registered = requests.post(f"{url}/v1/steering/vectors/register", timeout=60,
                               json={"name": "shared", "vectors": {"post_block": {"10": vector(7, norm=40.0)}}})
    assert registered.status_code == 200, registered.text
    set_global = requests.post(f"{url}/v1/steering/set", timeout=60,
                               json={"vectors": {"post_block": {"3": vector(8)}}})
    assert set_global.status_code == 200, set_global.text

    # Concurrent streams on connections of their own spread over both servers; while they run, each server
    # holds some of them. Every one names the vector registered above. Which server accepts a connection is the
    # kernel's choice: on a loaded host one server can take a whole wave, so waves go on until both have held one.
    body = {"model": "m", "prompt": "The capital of France is", "max_tokens": 48, "temperature": 0,
            "ignore_eos": True, "steering_name": "shared"}
    body["model"] = requests.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    held, results = set(), []
    for _ in range(WAVES):
        held |= _wave_of_streams(url, body, servers, port, results)
        if len(held) == 2:
            break
    assert len(held) == 2, f"{WAVES} waves of streams all went to one API server: the test proves nothing"
    assert all(status == 200 for status, _ in results), results
    assert len({text for _, text in results}) == 1  # one engine, one steering config, greedy

    # Every server describes the same global vectors and names (fresh connections, several per server).
    with ThreadPoolExecutor(8) as pool:
        described = list(pool.map(lambda _: requests.get(f"{url}/v1/steering", timeout=30,
                                                         headers={"Connection": "close"}).json(), range(16)))
        names = list(pool.map(lambda _: requests.get(f"{url}/v1/steering/vectors", timeout=30,
                                                     headers={"Connection": "close"}).json(), range(16)))
    assert all(d == described[0] for d in described) and list(described[0]["vectors"]["post_block"]) == ["3"]
    assert all(n == {"names": ["shared"]} for n in names)
