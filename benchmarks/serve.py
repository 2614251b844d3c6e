"""Serving benchmark: plain vLLM against `vllm-interp serve` on the same model, streaming clients, as ratios.

    python -m benchmarks.serve MODEL --out FILE.md [--concurrency 128] [--prompt-tokens 512]
        [--max-tokens 512] [--rounds 2] [--workloads idle,steer_distinct,...] [--server-arg=--enforce-eager ...]

Both servers start once, side by side, each with its engine core in its own process (how users run them):
plain `vllm serve` and `vllm-interp serve`, both on the model runner vLLM picks (V2 for dense models on GPUs;
``--runner v1`` puts both on V1, so the ratios compare like with like either way), vllm-interp with steering,
patching and the inline
and filesystem consumers enabled. Every round runs each workload as a pair, A then B: the same fresh prompts
against plain vLLM without fields (the baseline) and against vllm-interp with the workload's fields, so drift
shows as rounds that disagree. Ratios are feature / baseline; the summary takes the median over rounds.

Workloads (concurrency N unless said): ``idle`` (every feature enabled, requests without fields; also at
concurrency 1), ``steer_distinct`` (each request its own random vectors at every layer's post_block),
``steer_shared`` (one such set for all), ``steer_global`` (the set as global vectors, requests without
fields), ``capture_inline`` / ``capture_filesystem`` (``last_prompt`` at every site), ``patched`` (not
streamed, as patching requires: one position of every layer patched from a stored run; latency instead of
TTFT). Clients are threads on ``http.client`` (the GPU machine has no HTTP client libraries), spread over
eight processes so that parsing the streams never limits the run.
"""

import argparse
import http.client
import json
import multiprocessing
import os
import re
import statistics
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from benchmarks.serving import VLLM_INTERP_MODULE, VLLM_MODULE, launch_server, stop_server, wait_healthy
from vllm_interp import pack_vectors

WORKLOADS = ("idle", "idle_c1", "steer_distinct", "steer_shared", "steer_global", "capture_inline",
             "capture_filesystem", "patched")
SOURCE_RUN = "bench-source"
CLIENT_PROCESSES = 8


@dataclass
class Sample:
    ttft_s: float | None  # None: not streamed
    latency_s: float
    tokens: int
    error: str | None = None


@dataclass
class RunStats:
    samples: list[Sample]
    wall_s: float

    @property
    def ok(self) -> list[Sample]:
        return [s for s in self.samples if s.error is None]

    @property
    def errors(self) -> int:
        return len(self.samples) - len(self.ok)

    def ttft_ms(self) -> float | None:
        values = [s.ttft_s for s in self.ok if s.ttft_s is not None]
        return 1000 * statistics.mean(values) if values else None

    def tpot_ms(self) -> float | None:
        values = [(s.latency_s - s.ttft_s) / (s.tokens - 1) for s in self.ok if s.ttft_s is not None and s.tokens > 1]
        return 1000 * statistics.mean(values) if values else None

    def latency_s(self) -> float:
        return statistics.mean(s.latency_s for s in self.ok) if self.ok else float("nan")

    def throughput(self) -> float:
        return sum(s.tokens for s in self.ok) / self.wall_s


def post(url: str, path: str, body: dict[str, Any], timeout: float = 600) -> dict[str, Any]:
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    try:
        connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        payload = response.read()
        if response.status != 200:
            raise RuntimeError(f"{path}: HTTP {response.status}: {payload[:300]!r}")
        return json.loads(payload) if payload else {}
    finally:
        connection.close()


def completion(url: str, body: dict[str, Any]) -> Sample:
    """One /v1/completions request; streamed ones time their first and last token."""
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=900)
    started = time.perf_counter()
    try:
        connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            return Sample(None, 0.0, 0, f"HTTP {response.status}: {response.read()[:200]!r}")
        if not body.get("stream"):
            data = json.loads(response.read())
            return Sample(None, time.perf_counter() - started, data["usage"]["completion_tokens"])
        first = last = None
        while line := response.readline():
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return Sample(None, 0.0, 0, str(event["error"])[:200])
            if any(choice.get("text") for choice in event.get("choices") or []):
                last = time.perf_counter()
                first = first or last
        if first is None:
            return Sample(None, 0.0, 0, "no token streamed")
        # ignore_eos: every request generates max_tokens; chunks may carry several tokens each.
        return Sample(first - started, last - started, body["max_tokens"])
    except (OSError, http.client.HTTPException, ValueError) as exc:
        return Sample(None, 0.0, 0, repr(exc)[:200])
    finally:
        connection.close()


def _client(url: str, bodies: list[dict[str, Any]], threads: int) -> list[Sample]:
    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(lambda body: completion(url, body), bodies))


def run_requests(url: str, bodies: list[dict[str, Any]], concurrency: int) -> RunStats:
    """Send ``bodies`` with ``concurrency`` requests in flight, from up to CLIENT_PROCESSES processes: one
    Python process parsing the events of 128 streams would be the bottleneck (and its noise) of the run."""
    processes = max(1, min(CLIENT_PROCESSES, concurrency, len(bodies)))
    shares = [bodies[i::processes] for i in range(processes)]
    threads = -(-concurrency // processes)
    started = time.perf_counter()
    with ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("fork")) as pool:
        results = list(pool.map(_client, [url] * processes, shares, [threads] * processes))
    wall_s = time.perf_counter() - started
    samples = [results[i % processes][i // processes] for i in range(len(bodies))]  # back in request order
    return RunStats(samples, wall_s)


@dataclass
class Bench:
    args: argparse.Namespace
    plain_url: str
    interp_url: str
    layers: int
    hidden: int
    vocab: int
    pairs: list[tuple[int, str, RunStats, RunStats]] = field(default_factory=list)

    def prompts(self, seed: int, count: int) -> list[list[int]]:
        rng = np.random.default_rng(seed)
        return rng.integers(100, self.vocab - 100, size=(count, self.args.prompt_tokens)).tolist()

    def vectors(self, seed: int) -> dict[str, Any]:
        rng = np.random.default_rng(seed)
        table = rng.standard_normal((self.layers, self.hidden)).astype(np.float32) * 0.01
        return {"post_block": pack_vectors({layer: table[layer] for layer in range(self.layers)})}

    def body(self, prompt: list[int], stream: bool = True) -> dict[str, Any]:
        return {"model": self.args.model, "prompt": prompt, "max_tokens": self.args.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": stream}

    def workload(self, name: str, seed: int) -> tuple[int, bool, Callable[[int], dict[str, Any]]]:
        """(concurrency, streamed, request index -> the feature run's extra fields)."""
        n = self.args.concurrency
        shared = self.vectors(seed)
        position = self.args.prompt_tokens // 2
        capture = {"hooks": "all", "positions": "last_prompt"}
        return {
            "idle": (n, True, lambda i: {}),
            "idle_c1": (1, True, lambda i: {}),
            "steer_distinct": (n, True, lambda i: {"steering_vectors": self.vectors(seed * 1000 + i)}),
            "steer_shared": (n, True, lambda i: {"steering_vectors": shared}),
            "steer_global": (n, True, lambda i: {}),
            "capture_inline": (n, True, lambda i: {"capture": {"inline": capture}}),
            "capture_filesystem": (n, True, lambda i: {"capture": {"filesystem": capture}}),
            "patched": (n, False, lambda i: {"patch": [
                {"layer": layer, "hook": "post_block", "position": position,
                 "source": {"run": SOURCE_RUN, "position": position}} for layer in range(self.layers)]}),
        }[name]

    def run_pair(self, round_index: int, name: str) -> None:
        seed = 1000 * round_index + WORKLOADS.index(name)
        concurrency, stream, fields = self.workload(name, seed)
        count = max(concurrency, self.args.requests) if concurrency > 1 else self.args.requests_c1
        prompts = self.prompts(seed, count)
        if name == "steer_global":
            post(self.interp_url, "/v1/steering/set", {"vectors": self.vectors(seed)})
        if name == "patched":
            source = {**self.body(self.prompts(seed + 500, 1)[0], stream=False), "max_tokens": 1,
                      "capture": {"patch_source": {"hooks": {"post_block": "all"}, "positions": "all_prompt",
                                                   "tag": SOURCE_RUN}}}
            post(self.interp_url, "/v1/completions", source)
        try:
            baseline = run_requests(self.plain_url, [self.body(p, stream) for p in prompts], concurrency)
            feature = run_requests(self.interp_url, [{**self.body(p, stream), **fields(i)}
                                                     for i, p in enumerate(prompts)], concurrency)
        finally:
            if name == "steer_global":
                post(self.interp_url, "/v1/steering/clear", {})
        self.pairs.append((round_index, name, baseline, feature))
        print(f"round {round_index} {name}: {describe(baseline)} | {describe(feature)}", flush=True)


def describe(stats: RunStats) -> str:
    ttft, tpot = stats.ttft_ms(), stats.tpot_ms()
    return (f"ttft {fmt(ttft)} ms tpot {fmt(tpot)} ms latency {stats.latency_s():.2f} s "
            f"{stats.throughput():.0f} tok/s errors {stats.errors}")


def fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def ratio(feature: float | None, baseline: float | None) -> float | None:
    return None if feature is None or baseline is None or baseline == 0 else feature / baseline


def column_medians(rows: list[tuple[float | None, ...]]) -> list[float | None]:
    """The median of each column of ``rows`` over the rows that have a value there (None: none has)."""
    return [statistics.median(v) if (v := [r[k] for r in rows if r[k] is not None]) else None
            for k in range(len(rows[0]))]


def kv_cache_tokens(log: Path) -> str:
    """The KV cache size the server's engine reported (unequal caches would make the ratios measure queueing)."""
    match = re.search(r"GPU KV cache size: ([\d,]+) tokens", log.read_text(errors="replace"))
    return match.group(1) if match else "unknown"


def report(bench: Bench, started: str, card: str, wall_s: float, kv_tokens: tuple[str, str]) -> str:
    args = bench.args
    lines = [f"# Serving: plain vLLM vs vllm-interp ({date.today().isoformat()})", "",
             f"- Card: {card}", f"- Model: `{args.model}` ({bench.layers} layers, hidden {bench.hidden})",
             f"- Requests: {args.requests} at concurrency {args.concurrency} ({args.requests_c1} one at a time for "
             f"idle_c1), {args.prompt_tokens} random prompt tokens, {args.max_tokens} generated (ignore_eos), greedy",
             f"- Model runner (both servers): {args.runner}; server args: `{' '.join(args.server_arg)}`",
             f"- KV cache: plain {kv_tokens[0]} tokens, vllm-interp {kv_tokens[1]} tokens",
             f"- Started {started}; {args.rounds} rounds, A (plain) then B (vllm-interp) per workload; {wall_s:.0f} s",
             "", "| round | workload | TTFT ms A / B | TPOT ms A / B | tok/s A / B | TTFT ratio | TPOT ratio | "
             "throughput ratio | latency ratio | errors A / B |", "|---|---|---|---|---|---|---|---|---|---|"]
    by_workload: dict[str, list[tuple[float | None, ...]]] = {}
    for round_index, name, a, b in bench.pairs:
        ratios = (ratio(b.ttft_ms(), a.ttft_ms()), ratio(b.tpot_ms(), a.tpot_ms()),
                  ratio(b.throughput(), a.throughput()), ratio(b.latency_s(), a.latency_s()))
        by_workload.setdefault(name, []).append(ratios)
        lines.append(f"| {round_index} | {name} | {fmt(a.ttft_ms())} / {fmt(b.ttft_ms())} | {fmt(a.tpot_ms(), 2)} / "
                     f"{fmt(b.tpot_ms(), 2)} | {a.throughput():.0f} / {b.throughput():.0f} | "
                     + " | ".join(fmt(r, 3) for r in ratios) + f" | {a.errors} / {b.errors} |")
    lines += ["", "Median over rounds (feature / baseline):", "",
              "| workload | TTFT | TPOT | throughput | latency |", "|---|---|---|---|---|"]
    for name, rows in by_workload.items():
        medians = column_medians(rows)
        lines.append(f"| {name} | " + " | ".join(fmt(m, 3) for m in medians) + " |")
    return "\n".join(lines) + "\n"


def gpu_card() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, check=True).stdout.strip().replace("\n", "; ")
    except (OSError, subprocess.CalledProcessError):
        return f"CPU ({os.cpu_count()} cores)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model")
    parser.add_argument("--out", required=True)
    parser.add_argument("--workdir", default="/tmp/vllm-interp-serve-bench")
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--requests-c1", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--runner", choices=("default", "v1"), default="default",
                        help="default: the one vLLM picks (V2 on GPUs); v1: VLLM_USE_V2_MODEL_RUNNER=0")
    parser.add_argument("--server-arg", action="append", default=[], help="passed to both servers (repeatable)")
    parser.add_argument("--start-timeout", type=float, default=600)
    args = parser.parse_args()
    names = args.workloads.split(",")
    if unknown := sorted(set(names) - set(WORKLOADS)):
        parser.error(f"unknown workloads {unknown} (known: {', '.join(WORKLOADS)})")
    config = json.loads((Path(args.model) / "config.json").read_text())
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    common = [args.model, "--max-model-len", str(args.prompt_tokens + args.max_tokens + 16), *args.server_arg]
    # Plain vLLM loads none of vllm-interp's plugins (they are visible to it through entry points).
    runner_env = {"VLLM_USE_V2_MODEL_RUNNER": "0"} if args.runner == "v1" else {}
    plain_env = {**os.environ, "VLLM_PLUGINS": "", **runner_env}
    interp_args = ["--enable-steering", "--max-steering-configs", str(max(args.concurrency, 8)), "--enable-patching",
                   "--capture-consumers", "inline", "--capture-consumers", f"filesystem:root={workdir / 'captures'}"]
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    began = time.monotonic()
    plain_url, plain = launch_server(common, workdir / "plain.log", plain_env, VLLM_MODULE)
    interp_url, interp = launch_server([*common, *interp_args], workdir / "interp.log", {**os.environ, **runner_env},
                                       VLLM_INTERP_MODULE)
    try:
        wait_healthy(plain_url, plain, workdir / "plain.log", args.start_timeout)
        wait_healthy(interp_url, interp, workdir / "interp.log", args.start_timeout)
        print(f"servers ready after {time.monotonic() - began:.0f} s", flush=True)
        kv_tokens = (kv_cache_tokens(workdir / "plain.log"), kv_cache_tokens(workdir / "interp.log"))
        bench = Bench(args, plain_url, interp_url, config["num_hidden_layers"], config["hidden_size"],
                      config["vocab_size"])
        warm_up = [bench.body(p) for p in bench.prompts(99, 2)]  # first requests pay one-off costs; not reported
        run_requests(plain_url, warm_up, 2)
        run_requests(interp_url, warm_up, 2)
        for round_index in range(args.rounds):
            for name in names:
                bench.run_pair(round_index, name)
    finally:
        stop_server(plain)
        stop_server(interp)
    text = report(bench, started, gpu_card(), time.monotonic() - began, kv_tokens)
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
