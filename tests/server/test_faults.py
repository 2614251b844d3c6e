"""Faults: a client that disconnects releases what its request held (steering slots, a sweep's source run and
cells); an engine core killed under load makes the API server answer errors and exit, never hang."""

import os
import signal
import threading
import time

import psutil
import requests

from tests.conftest import API_KEY, SERVER_ARGS, launch_server, stop_server, vector

CLEAN = "The Eiffel Tower is located in the city of"
CORRUPT = "The Colosseum is located in the city of"


def _running(url: str) -> float:
    """vLLM's gauge of requests running in the engine."""
    for line in requests.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:num_requests_running"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no vllm:num_requests_running in /metrics")


def _wait_idle(url: str, timeout_s: float = 30) -> None:
    deadline = time.time() + timeout_s
    while _running(url) and time.time() < deadline:
        time.sleep(0.2)
    assert _running(url) == 0, "requests of disconnected clients still run"


def _open_stream(url: str, body: dict, path: str = "/v1/completions") -> requests.Response:
    """A streamed request whose first event has arrived (the request is running in the engine)."""
    reply = requests.post(f"{url}{path}", json={**body, "stream": True}, stream=True, timeout=120)
    assert reply.status_code == 200, reply.text
    next(line for line in reply.iter_lines() if line.startswith(b"data:"))
    return reply


def test_disconnected_steered_requests_give_back_their_slots(server):
    """The server holds 2 per-request steering configs. Two long steered streams take both; their clients go
    away; two requests with new vectors must then be admitted (were the slots not released, they would wait
    for requests that no longer run)."""
    url, _ = server
    long_body = {"prompt": "Tell me a long story.", "max_tokens": 400, "ignore_eos": True, "temperature": 0}
    streams = [_open_stream(url, {**long_body, "steering_vectors": {"post_block": {"4": vector(100 + i)}}})
               for i in range(2)]
    for stream in streams:
        stream.close()
    _wait_idle(url)
    for i in range(2):
        body = {"prompt": "Hello", "max_tokens": 2, "steering_vectors": {"post_block": {"5": vector(200 + i)}}}
        assert requests.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 200


def test_a_disconnected_sweep_cancels_its_cells_and_drops_its_source_run(server):
    url, _ = server
    body = {"prompt": CORRUPT, "clean_prompt": CLEAN, "hooks": ["post_block", "pre_attn"], "answer_token": " Paris",
            "stream": True}
    reply = requests.post(f"{url}/v1/patch_sweep", json=body, stream=True, timeout=120)
    kind = None
    for line in reply.iter_lines(decode_unicode=True):
        if line.startswith("event:"):
            kind = line.split(":", 1)[1].strip()
        elif line.startswith("data:") and kind == "cell":
            break  # the clean run is stored and the cells are running
    reply.close()
    _wait_idle(url)
    deadline = time.time() + 30
    while time.time() < deadline:
        runs = [r["run_id"] for r in requests.get(f"{url}/v1/patch_sources", timeout=10).json()["runs"]]
        if not any(run.startswith("sweep-") for run in runs):
            break
        time.sleep(0.2)
    assert not any(run.startswith("sweep-") for run in runs), f"the sweep's source run outlived it: {runs}"
    assert requests.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, timeout=30).ok


def _engine_core(api_server: psutil.Process) -> psutil.Process:
    for child in api_server.children(recursive=True):
        if "EngineCore" in " ".join(child.cmdline()) or child.name().startswith("VLLM::EngineCore"):
            return child
    raise AssertionError(f"no engine core among {[c.name() for c in api_server.children(recursive=True)]}")


def test_a_killed_engine_core_makes_the_api_server_answer_errors_and_exit(tmp_path):
    url, process = launch_server([*SERVER_ARGS, "--enable-steering", "--steering-api-key", API_KEY,
                                  "--capture-consumers", f"filesystem:root={tmp_path / 'captures'}"],
                                 tmp_path / "server.log")
    outcomes: list[str] = []

    def stream(i: int) -> None:
        body = {"prompt": "Count to one thousand:", "max_tokens": 400, "ignore_eos": True, "stream": True,
                "steering_vectors": {"post_block": {"3": vector(i)}}}
        try:
            with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=120) as reply:
                events = [line.removeprefix(b"data: ") for line in reply.iter_lines() if line.startswith(b"data:")]
        except requests.RequestException:
            outcomes.append("cut")
            return
        if any(b'"error"' in event for event in events):
            outcomes.append("error event")
        else:
            outcomes.append("finished" if events and events[-1] == b"[DONE]" else "cut")

    try:
        clients = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(3)]
        for client in clients:
            client.start()
        deadline = time.time() + 60
        while _running(url) < 3 and time.time() < deadline:
            time.sleep(0.2)
        _engine_core(psutil.Process(process.pid)).send_signal(signal.SIGKILL)
        for client in clients:
            client.join(60)
        # Each stream ends with an error event, or is cut off: none reports a normal end.
        assert len(outcomes) == 3 and "finished" not in outcomes, f"in-flight requests after the kill: {outcomes}"
        process.wait(90)  # the API server notices the dead engine and exits by itself
        assert process.returncode is not None
        # Orphaned workers notice their parent's death on their own schedule (seconds on a loaded machine).
        _, leftovers = psutil.wait_procs([p for p in psutil.process_iter(["pid"]) if _in_group(p, process.pid)],
                                         timeout=20)
        assert not leftovers, f"processes of the server outlived it: {[p.name() for p in leftovers]}"
    finally:
        if process.poll() is None:
            stop_server(process)


def _in_group(process: psutil.Process, group: int) -> bool:
    try:
        return os.getpgid(process.pid) == group and process.status() != psutil.STATUS_ZOMBIE
    except (ProcessLookupError, psutil.NoSuchProcess):
        return False
