"""Soak: a bounded mixed load on one `vllm-interp serve` for a set time, watching errors, latency and memory.

    python -m benchmarks.soak [--minutes 30] [--clients 4] [--out benchmarks/results/soak-cpu-DATE.md]

Every client loops over a random mix of: plain, steered, capturing to files, capturing inline, patched
(from a stored source run), a sweep, a sweep the client leaves after its first cell, a stream the client
leaves after its first token, global set/clear, named register/use/unregister. Every 10 s the RSS of every
server process is sampled. At the end: every capture file a 200 answered for is complete and readable, no
sweep's source run is left (leases released), nothing runs in the engine. Reports errors, p50/p99 latency
per action and RSS at the end of warm-up and at the end per process, with the trend between.
"""

import argparse
import json
import random
import statistics
import tempfile
import threading
import time
from collections import defaultdict
from datetime import date
from pathlib import Path

import numpy as np
import requests

from benchmarks.serving import server_rss_mb, start_server, stop_server
from vllm_interp.capture.consumers.filesystem import list_captures, read_capture

HIDDEN, LAYERS = 576, 30
CLEAN = "The Eiffel Tower is located in the city of"
CORRUPT = "The Colosseum is located in the city of"
SOURCE_RUN = "soak-clean"


def _vector(rng: random.Random, norm: float = 6.0) -> list[float]:
    v = np.random.default_rng(rng.randrange(2**32)).standard_normal(HIDDEN)
    return (v / np.linalg.norm(v) * norm).tolist()


class Soak:
    def __init__(self, url: str, root: Path) -> None:
        self.url = url
        self.root = root
        self.latency: dict[str, list[float]] = defaultdict(list)
        self.errors: list[str] = []
        self.tags: list[str] = []
        self.lock = threading.Lock()
        self.counter = 0

    def _post(self, path: str, body: dict, **kwargs) -> requests.Response:
        return requests.post(f"{self.url}{path}", json=body, timeout=300, **kwargs)

    def _next(self) -> int:
        with self.lock:
            self.counter += 1
            return self.counter

    def _expect(self, action: str, reply: requests.Response, check=None) -> None:
        problem = None if reply.status_code == 200 else f"{reply.status_code} {reply.text[:300]}"
        if problem is None and check is not None:
            problem = check(reply.json())
        if problem:
            with self.lock:
                self.errors.append(f"{action}: {problem}")

    # -- actions -----------------------------------------------------------------------------------------
    def plain(self, rng):
        self._expect("plain", self._post("/v1/completions", {"prompt": "Tell me about soup.", "max_tokens": 16}))

    def steered(self, rng):
        body = {"prompt": "My favourite season is", "max_tokens": 16,
                "steering_vectors": {"post_block": {str(rng.randrange(LAYERS)): _vector(rng)}}}
        self._expect("steered", self._post("/v1/completions", body))

    def capture_file(self, rng):
        tag = f"soak/{self._next():06d}"
        body = {"prompt": "The quick brown fox jumps over the lazy dog.", "max_tokens": 4,
                "capture": {"filesystem": {"hooks": {"post_block": "all"}, "positions": "all_prompt", "tag": tag}}}
        reply = self._post("/v1/completions", body)
        self._expect("capture_file", reply, lambda d: None if d["capture_results"]["filesystem"]["status"] == "ok"
                     else d["capture_results"])
        if reply.status_code == 200:
            with self.lock:
                self.tags.append(tag)

    def capture_inline(self, rng):
        body = {"prompt": "Once upon a time", "max_tokens": 8,
                "capture": {"inline": {"hooks": {"pre_attn": [rng.randrange(LAYERS)]}, "positions": "all"}}}
        self._expect("capture_inline", self._post("/v1/completions", body),
                     lambda d: None if d["capture_results"]["inline"]["status"] == "ok" else d["capture_results"])

    def patched(self, rng):
        patch = [{"layer": rng.randrange(LAYERS), "hook": "post_block", "position": p,
                  "source": {"run": SOURCE_RUN, "position": p}} for p in (1, 2, 3)]
        self._expect("patched", self._post("/v1/completions", {"prompt": CORRUPT, "max_tokens": 1, "patch": patch}))

    def sweep(self, rng):
        body = {"prompt": CORRUPT, "source_run": SOURCE_RUN, "layers": [0, 10, 20], "answer_token": " Paris"}
        self._expect("sweep", self._post("/v1/patch_sweep", body),
                     lambda d: d["errors"] or None)

    def sweep_disconnect(self, rng):
        body = {"prompt": CORRUPT, "clean_prompt": CLEAN, "layers": "all", "answer_token": " Paris", "stream": True}
        with self._post("/v1/patch_sweep", body, stream=True) as reply:
            for line in reply.iter_lines():
                if line.startswith(b"event: cell"):
                    break

    def stream_disconnect(self, rng):
        body = {"prompt": "Count slowly:", "max_tokens": 200, "ignore_eos": True, "stream": True,
                "steering_vectors": {"post_attn": {str(rng.randrange(LAYERS)): _vector(rng)}}}
        with self._post("/v1/completions", body, stream=True) as reply:
            for line in reply.iter_lines():
                if line.startswith(b"data:"):
                    break

    def global_set_clear(self, rng):
        spec = {"vectors": {"post_block": {str(rng.randrange(LAYERS)): _vector(rng, 2.0)}}}
        self._expect("global_set", self._post("/v1/steering/set", spec))
        self.plain(rng)
        self._expect("global_clear", self._post("/v1/steering/clear", {}))

    def named(self, rng):
        name = f"soak-{self._next()}"
        self._expect("named_register", self._post("/v1/steering/vectors/register",
                                                  {"name": name, "vectors": {"post_block": {"7": _vector(rng)}}}))
        self._expect("named_use", self._post("/v1/completions", {"prompt": "Hi", "max_tokens": 4,
                                                                  "steering_name": name}))
        self._expect("named_unregister", self._post("/v1/steering/vectors/unregister", {"name": name}))

    ACTIONS = ("plain", "steered", "capture_file", "capture_inline", "patched", "sweep", "sweep_disconnect",
               "stream_disconnect", "global_set_clear", "named")

    def client(self, seed: int, stop_at: float) -> None:
        rng = random.Random(seed)
        while time.time() < stop_at:
            action = rng.choice(self.ACTIONS)
            started = time.monotonic()
            try:
                getattr(self, action)(rng)
            except (requests.RequestException, KeyError, ValueError) as exc:
                with self.lock:
                    self.errors.append(f"{action}: {type(exc).__name__}: {exc}")
            with self.lock:
                self.latency[action].append(time.monotonic() - started)

    def final_checks(self) -> list[str]:
        problems = []
        complete = set(list_captures(self.root))
        for tag in self.tags:
            if tag not in complete:
                problems.append(f"capture {tag} answered 200 but is not complete on disk")
                continue
            tensors, meta = read_capture(self.root, tag)
            if len(tensors) != LAYERS or any(t.shape[1] != HIDDEN for t in tensors.values()):
                problems.append(f"capture {tag} is unreadable or partial")
        runs = [r["run_id"] for r in requests.get(f"{self.url}/v1/patch_sources", timeout=30).json()["runs"]]
        if left := [r for r in runs if r != SOURCE_RUN]:
            problems.append(f"source runs left behind (leases not released): {left}")
        for line in requests.get(f"{self.url}/metrics", timeout=30).text.splitlines():
            if line.startswith("vllm:num_requests_running") and float(line.rsplit(" ", 1)[1]):
                problems.append(f"requests still running at the end: {line}")
        return problems


def _trend(samples: list[tuple[float, dict[str, float]]], warmup_s: float) -> dict[str, dict[str, float]]:
    """Per process: RSS at the end of warm-up, at the end, and the slope (MiB per 10 min) after warm-up."""
    start = samples[0][0]
    after = [(t - start, rss) for t, rss in samples if t - start >= warmup_s]
    out = {}
    for name in after[0][1]:
        points = [(t, rss[name]) for t, rss in after if name in rss]
        times, values = np.array([p[0] for p in points]), np.array([p[1] for p in points])
        slope = float(np.polyfit(times, values, 1)[0] * 600) if len(points) > 2 else 0.0
        out[name] = {"warm": values[0], "end": values[-1], "max": values.max(), "slope_mib_per_10min": slope}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30)
    parser.add_argument("--warmup-minutes", type=float, default=3)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--out", default=f"benchmarks/results/soak-cpu-{date.today()}.md")
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="vllm-interp-soak-"))
    root = workdir / "captures"
    server_args = ["--dtype", "float32", "--max-model-len", "1024", "--kv-cache-memory-bytes", str(512 << 20),
                   "--enable-steering", "--enable-patching", "--max-steering-configs", "4",
                   "--capture-consumers", "inline", "--capture-consumers", f"filesystem:root={root}"]
    url, process = start_server(server_args, workdir / "server.log")
    soak = Soak(url, root)
    capture = {"patch_source": {"hooks": {"post_block": "all"}, "positions": "all_prompt", "tag": SOURCE_RUN}}
    requests.post(f"{url}/v1/completions", json={"prompt": CLEAN, "max_tokens": 1, "capture": capture},
                  timeout=300).raise_for_status()

    samples: list[tuple[float, dict[str, float]]] = []
    stop_at = time.time() + args.minutes * 60
    clients = [threading.Thread(target=soak.client, args=(seed, stop_at), daemon=True) for seed in range(args.clients)]
    for client in clients:
        client.start()
    while any(client.is_alive() for client in clients):
        samples.append((time.time(), server_rss_mb(process.pid)))
        time.sleep(10)
    samples.append((time.time(), server_rss_mb(process.pid)))
    problems = soak.final_checks()
    stop_server(process)

    trend = _trend(samples, args.warmup_minutes * 60)
    total = sum(len(v) for v in soak.latency.values())
    lines = [f"# Soak on the CPU ({date.today()})", "",
             f"- Command: `python -m benchmarks.soak --minutes {args.minutes:g} --clients {args.clients}` on the "
             "2-core development machine; `vllm-interp serve` (default model, fp32, torch.compile) with steering, "
             "patching, inline and filesystem capture.",
             f"- {total} actions, {len(soak.errors)} errors, {len(soak.tags)} capture files checked; "
             f"final checks: {'all passed' if not problems else '; '.join(problems)}.", "",
             "| action | count | p50 s | p99 s |", "|---|---|---|---|"]
    for action, values in sorted(soak.latency.items()):
        q = statistics.quantiles(values, n=100) if len(values) > 1 else values * 99
        lines.append(f"| {action} | {len(values)} | {statistics.median(values):.2f} | {q[98]:.2f} |")
    lines += ["", f"RSS per server process (MiB) after {args.warmup_minutes:g} min of warm-up and at the end; slope "
              "of a line fitted to the samples after warm-up:", "",
              "| process | warm | end | max | slope MiB / 10 min |", "|---|---|---|---|---|"]
    for name, t in trend.items():
        slope = t["slope_mib_per_10min"]
        lines.append(f"| {name} | {t['warm']:.0f} | {t['end']:.0f} | {t['max']:.0f} | {slope:+.1f} |")
    if soak.errors:
        lines += ["", "Errors (first 20):", "", *[f"- {e}" for e in soak.errors[:20]]]
    report = "\n".join(lines) + "\n"
    Path(args.out).write_text(report)
    print(report)
    (workdir / "samples.json").write_text(json.dumps(samples))


if __name__ == "__main__":
    main()
