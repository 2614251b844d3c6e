"""Serving benchmark: plain vLLM against `vllm-interp serve` on the same model, streaming clients, as ratios.

    python -m benchmarks.serve MODEL --out FILE.md [--concurrency 128] [--prompt-tokens 512]
        [--max-tokens 512] [--requests 512] [--rounds 2] [--warmup-rounds 1] [--workloads idle,steer_distinct,...]
        [--pin-cpus]
        [--torch-profile capture_inline,...] [--torch-profile-stack] [--py-spy PATH]
        [--switch-intervals-ms 5,0.5] [--function-timers] [--server-arg=--enforce-eager ...]

Both servers start once, side by side, each with its engine core in its own process (how users run them):
plain `vllm serve` and `vllm-interp serve`, both on the model runner vLLM picks (V2 for dense models on GPUs;
``--runner v1`` puts both on V1, so the ratios compare like with like either way), vllm-interp with steering,
patching and the inline and filesystem consumers enabled. Every round runs each workload as a pair: the same
fresh prompts against plain vLLM without fields (A, the baseline) and against vllm-interp with the workload's
fields (B), A then B in even rounds and B then A in odd ones (the GPU and the host are shared, so whatever the
first run of a pair leaves behind falls on each server alike), and drift shows as rounds that disagree. Ratios
are feature / baseline; the summary takes the median over rounds. ``--warmup-rounds`` rounds (default 1) run
every workload's pair first, with prompts of their own, and are left out of the report: a server's first run of a
workload pays one-off costs (Triton compiling a new specialization of vLLM's attention kernel mid-run held one
round 0's TTFT at 2.0x on an H100).
Each run also reports the engine core's forward thread's time on a CPU and waiting for one (Linux's scheduler
statistics) and how busy the host's CPUs were: a serving step is host-bound at these sizes, so a forward thread
that waits for a CPU (taken by the clients or the API servers) makes that run slower, whichever server it is.
``--pin-cpus`` keeps them apart: the servers on the first half of the CPUs, the clients on the other half.
``--torch-profile WORKLOADS`` runs each named workload once more after the rounds, one wave on each server under
its torch profiler over the wave's first steps (``benchmarks/step_profile.py``): where a feature's prefill
steps spend their time on the device and in the forward thread's CUDA calls, against plain vLLM's;
``--torch-profile-stack`` records Python calls there too (the traces stay under ``WORKDIR/profiles``).
``--switch-intervals-ms A,B,...`` runs B once at each of these Python switch intervals in vllm-interp's engine
process (set on the running server before each run, through the worker's ``interp_switch_interval``; dev-mode
``/collective_rpc``), against the same A: each workload's rows then read ``NAME @ MS ms``, and a round runs
A then each interval in even rounds, the reverse in odd ones. B's prefix cache is reset before each of its runs
(dev-mode ``/reset_prefix_cache``): they share their prompts, and a second run would be served the first's blocks.
``--py-spy PATH`` (a py-spy binary) samples the server of every run of A and B at 200 Hz, idle time included, into
``WORKDIR/py-spy/py-spy-<round>-<workload>-<A|B>.txt`` (collapsed stacks per thread; ``--py-spy-gil`` instead:
only the thread holding each process's interpreter lock at each sample). ``--function-timers`` times a list of
engine functions inside both servers' engine cores (``benchmarks/function_timers.py``, loaded as a vLLM general
plugin by plain vLLM and vllm-interp alike) and reports each one's milliseconds per run, A / B: where a served
feature's extra time goes on the engine core's threads, by function.

Workloads (concurrency N unless said): ``idle`` (every feature enabled, requests without fields; also at
concurrency 1), ``steer_distinct`` (each request its own random vectors at every layer's post_block),
``steer_shared`` (one such set for all), ``steer_global`` (the set as global vectors, requests without
fields), ``capture_inline`` / ``capture_filesystem`` (``last_prompt`` at every site), ``patched`` (not
streamed, as patching requires: one position of every layer patched from a stored run; latency instead of
TTFT). Clients are threads on ``http.client`` (the GPU machine has no HTTP client libraries), spread over
eight processes so that parsing the streams never limits the run.

``--peer-site DIR`` (a directory holding the unpacked vllm-lens 1.2.1 wheel and its dependencies) starts a
third server, C: plain `vllm serve` with only vllm-lens's plugin loaded (it forces eager execution and vLLM's
V1 runner), run right after A and B with the same prompts for the workloads it has an equivalent of: ``idle``,
``idle_c1``, ``steer_distinct``, ``steer_shared`` (``apply_steering_vectors``: the same vectors, added to
every layer's output) and ``capture_inline`` (``output_residual_stream`` of every layer: vllm-lens captures
every position, where vllm-interp's workload captures the last prompt position). Its ratios are against the
same plain runs A.
"""

import argparse
import base64
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

import msgspec
import numpy as np

from benchmarks import function_timers, step_profile
from benchmarks.serving import (
    VLLM_INTERP_MODULE,
    VLLM_MODULE,
    ServerSampler,
    host_cpu_jiffies,
    launch_server,
    split_cpus,
    stop_server,
    thread_clocks,
    thread_clocks_ms,
    wait_healthy,
)
from vllm_interp import pack_vectors

WORKLOADS = ("idle", "idle_c1", "steer_distinct", "steer_shared", "steer_global", "capture_inline",
             "capture_filesystem", "patched")
PROFILED = ("idle", "steer_distinct", "steer_shared", "capture_inline", "capture_filesystem")  # no set-up of their own
PROFILE_STEPS = 16  # a wave of 128 x 512 prompt tokens prefills in 8 steps of 8,192 tokens
SOURCE_RUN = "bench-source"
CLIENT_PROCESSES = 8


@dataclass
class Sample:
    ttft_s: float | None  # None: not streamed
    latency_s: float
    tokens: int
    error: str | None = None
    # The gap before the last streamed chunk: a capturing stream's finishing chunk is held until the
    # request's capture results come (they ride on it), so this is where result delivery shows.
    last_gap_s: float = 0.0


# vLLM's own per-request histograms, read from each server's /metrics around every run: where the time to the
# first token goes. The engine's TTFT starts when vLLM's handler takes the request (after vllm-interp's
# middleware and the HTTP parse, which the client's TTFT includes); queue is the engine core's wait before a
# request is first scheduled (steering slots included); prefill runs from then to its first token.
ENGINE_METRICS = {"engine TTFT": "vllm:time_to_first_token_seconds", "queue": "vllm:request_queue_time_seconds",
                  "prefill": "vllm:request_prefill_time_seconds"}
# vllm-interp's own (vllm_interp/server/metrics.py): a capturing response's wait for its results after vLLM's
# last output, and their preparation on the API server.
RESULTS_METRICS = {"results wait": "vllm_interp:capture_results_wait_seconds",
                   "results prepare": "vllm_interp:capture_results_prepare_seconds"}
SERVER_METRICS = {**ENGINE_METRICS, **RESULTS_METRICS}
ENGINE_CORE_THREAD = "VLLM::EngineCore/main"  # ``thread_clocks``' label of the engine core's forward thread


@dataclass
class RunStats:
    samples: list[Sample]
    wall_s: float
    engine_ms: dict[str, float] = field(default_factory=dict)  # SERVER_METRICS' mean per request of the run
    # The server's threads over the run, by label: (threads, ms on a CPU, ms waiting for one); ``thread_clocks_ms``.
    threads: dict[str, tuple[int, float, float]] = field(default_factory=dict)
    host_busy: float | None = None  # the share of the host's CPUs in use over the run
    functions: function_timers.Totals = field(default_factory=dict)  # ``--function-timers``: over the run

    def forward_thread(self) -> tuple[float, float] | None:
        """The engine core's main thread (the one that schedules and launches each step): (ms on a CPU, ms
        waiting for one), or None where not measured (offline, or an engine core in the server's process)."""
        clocks = self.threads.get(ENGINE_CORE_THREAD)
        return None if clocks is None else clocks[1:]

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

    def last_gap_ms(self) -> float | None:
        values = [s.last_gap_s for s in self.ok if s.ttft_s is not None]
        return 1000 * statistics.median(values) if values else None

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


def worker_call(url: str, method: str, **kwargs: Any) -> Any:
    """Rank 0's answer to one of the worker's ``interp_*`` methods, through vLLM's dev-mode ``/collective_rpc``."""
    return post(url, "/collective_rpc", {"method": method, "kwargs": kwargs}, timeout=60)["results"][0]


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
        first = last = previous = None
        while line := response.readline():
            # Timed on arrival: parsing a chunk that carries capture results (800 KB of statistics) is the
            # client's work, and its other streams' chunks wait for it on this process's interpreter.
            arrived = time.perf_counter()
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            event = msgspec.json.decode(line[6:])
            if "error" in event:
                return Sample(None, 0.0, 0, str(event["error"])[:200])
            # Every chunk with a choice carries a token, even with no text (a random model's special tokens
            # decode to ""; such a stream used to count as failed).
            if event.get("choices"):
                previous, last = last, arrived
                first = first or last
        if first is None:
            return Sample(None, 0.0, 0, "no token streamed")
        # ignore_eos: every request generates max_tokens; chunks may carry several tokens each.
        return Sample(first - started, last - started, body["max_tokens"], last_gap_s=last - (previous or last))
    except (OSError, http.client.HTTPException, ValueError) as exc:
        return Sample(None, 0.0, 0, repr(exc)[:200])
    finally:
        connection.close()


def _client(url: str, bodies: list[dict[str, Any]], threads: int) -> list[Sample]:
    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(lambda body: completion(url, body), bodies))


def histogram_sums(url: str) -> dict[str, tuple[float, float]]:
    """SERVER_METRICS' (sum, count) on the server now (zeros for those it does not serve)."""
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    try:
        connection.request("GET", "/metrics")
        text = connection.getresponse().read().decode()
    finally:
        connection.close()
    totals = {name: [0.0, 0.0] for name in SERVER_METRICS.values()}
    for line in text.splitlines():
        series, _, value = line.rpartition(" ")
        name = series.split("{", 1)[0]
        for suffix, index in (("_sum", 0), ("_count", 1)):
            if name.endswith(suffix) and name[: -len(suffix)] in totals:
                totals[name[: -len(suffix)]][index] += float(value)
    return {label: tuple(totals[name]) for label, name in SERVER_METRICS.items()}


def run_requests(url: str, bodies: list[dict[str, Any]], concurrency: int, server_pid: int | None = None,
                 client_cpus: set[int] | None = None) -> RunStats:
    """Send ``bodies`` with ``concurrency`` requests in flight, from up to CLIENT_PROCESSES processes (on
    ``client_cpus``, where given): one Python process parsing the events of 128 streams would be the bottleneck
    (and its noise) of the run. With ``server_pid``, the server's threads' clocks over the run are kept too."""
    processes = max(1, min(CLIENT_PROCESSES, concurrency, len(bodies)))
    shares = [bodies[i::processes] for i in range(processes)]
    threads = -(-concurrency // processes)
    before = histogram_sums(url)
    clocks_before = thread_clocks(server_pid) if server_pid else {}
    host_before = host_cpu_jiffies()
    started = time.perf_counter()
    pinning = {"initializer": os.sched_setaffinity, "initargs": (0, client_cpus)} if client_cpus else {}
    with ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("fork"), **pinning) as pool:
        results = list(pool.map(_client, [url] * processes, shares, [threads] * processes))
    wall_s = time.perf_counter() - started
    host_after = host_cpu_jiffies()
    server_threads = thread_clocks_ms(clocks_before, thread_clocks(server_pid)) if server_pid else {}
    after = histogram_sums(url)
    samples = [results[i % processes][i // processes] for i in range(len(bodies))]  # back in request order
    engine_ms = {label: 1000 * (after[label][0] - before[label][0]) / count
                 for label in SERVER_METRICS if (count := after[label][1] - before[label][1]) > 0}
    host_busy = (host_after[0] - host_before[0]) / max(1, host_after[1] - host_before[1])
    return RunStats(samples, wall_s, engine_ms, server_threads, host_busy)


@dataclass
class Bench:
    args: argparse.Namespace
    plain_url: str
    interp_url: str
    layers: int
    hidden: int
    vocab: int
    lens_url: str | None = None
    pids: dict[str, int] = field(default_factory=dict)  # url -> the server's pid, for its threads' clocks
    timers: dict[str, Path] = field(default_factory=dict)  # url -> where its engine's function timers write
    client_cpus: set[int] | None = None  # ``--pin-cpus``: where the clients run
    py_spy: str | None = None  # ``--py-spy``: the binary that samples each run's server
    py_spy_gil: bool = False  # ``--py-spy-gil``: only the threads holding the interpreter lock
    intervals: list[float] = field(default_factory=list)  # ``--switch-intervals-ms``: B's engine switch intervals
    # (round, workload, plain A, vllm-interp B, vllm-lens C or None)
    pairs: list[tuple[int, str, RunStats, RunStats, RunStats | None]] = field(default_factory=list)

    def prompts(self, seed: int, count: int) -> list[list[int]]:
        rng = np.random.default_rng(seed)
        return rng.integers(100, self.vocab - 100, size=(count, self.args.prompt_tokens)).tolist()

    def table(self, seed: int) -> np.ndarray:
        """One random steering vector per layer, ``[layers, hidden]``."""
        return np.random.default_rng(seed).standard_normal((self.layers, self.hidden)).astype(np.float32) * 0.01

    def vectors(self, seed: int) -> dict[str, Any]:
        table = self.table(seed)
        return {"post_block": pack_vectors({layer: table[layer] for layer in range(self.layers)})}

    def lens_vectors(self, seed: int) -> dict[str, Any]:
        """The same vectors as vllm-lens's HTTP form: a JSON list of ``SteeringVector`` dumps in ``vllm_xargs``
        (its tensor form: base64 of the raw bytes, which it also reads uncompressed)."""
        table = self.table(seed)
        activations = {"data": base64.b64encode(table.tobytes()).decode("ascii"), "dtype": "float32",
                       "original_dtype": "torch.float32", "shape": list(table.shape)}
        vector = {"activations": activations, "layer_indices": list(range(self.layers)), "scale": 1.0,
                  "norm_match": False, "position_indices": None}
        return {"vllm_xargs": {"apply_steering_vectors": json.dumps([vector])}}

    def lens_workload(self, name: str, seed: int) -> Callable[[int], dict[str, Any]] | None:
        """Request index -> vllm-lens's fields for the workload's equivalent (None: it has none)."""
        shared = self.lens_vectors(seed)
        capture = {"vllm_xargs": {"output_residual_stream": json.dumps(list(range(self.layers)))}}
        return {
            "idle": lambda i: {},
            "idle_c1": lambda i: {},
            "steer_distinct": lambda i: self.lens_vectors(seed * 1000 + i),
            "steer_shared": lambda i: shared,
            "capture_inline": lambda i: capture,
        }.get(name)

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

    def run(self, url: str, prompts: list[list[int]], stream: bool, concurrency: int,
            fields: Callable[[int], dict[str, Any]] = lambda i: {}, sample_as: str | None = None) -> RunStats:
        """The prompts as requests to ``url``, each with ``fields(its index)`` added; with ``--py-spy``, a run
        given a ``sample_as`` label has its server sampled into ``WORKDIR/py-spy/py-spy-LABEL.txt``."""
        bodies = [{**self.body(p, stream), **fields(i)} for i, p in enumerate(prompts)]
        sampler = None
        if self.py_spy is not None and sample_as is not None:
            out_dir = Path(self.args.workdir) / "py-spy"
            out_dir.mkdir(exist_ok=True)
            sampler = ServerSampler(self.py_spy, self.pids[url], out_dir, self.py_spy_gil)
            sampler.start(sample_as)
        timers = self.timers.get(url)
        before = function_timers.read_totals(timers) if timers else {}
        try:
            stats = run_requests(url, bodies, concurrency, self.pids.get(url), self.client_cpus)
        finally:
            if sampler is not None:
                sampler.stop()
        if timers:
            time.sleep(3 * function_timers.WRITE_EVERY_S)  # the run's last totals written
            stats.functions = function_timers.difference(function_timers.read_totals(timers), before)
        return stats

    def profile_pair(self, name: str, profiles: Path) -> list[str]:
        """One more wave of ``name`` (``--concurrency`` requests) on each server with its torch profiler over the
        wave's first ``PROFILE_STEPS`` engine steps (its prefill steps, then decode): each step's device time by
        kernel and the forward thread's CUDA calls, A against B. Left out of the ratios: the profiler slows
        what it records."""
        seed = 1000 * self.args.rounds + WORKLOADS.index(name)
        concurrency, stream, fields = self.workload(name, seed)
        prompts = self.prompts(seed, concurrency)
        sections = []
        for server, url, extra in (("plain", self.plain_url, lambda i: {}), ("interp", self.interp_url, fields)):
            since = time.time()
            step_profile.post(url, "/start_profile")
            self.run(url, prompts, stream, concurrency, extra)
            step_profile.post(url, "/stop_profile")
            sections.append(step_profile.summarise(step_profile.traces_since(profiles / server, since),
                                                   f"{name}: {server}", PROFILE_STEPS))
        return sections

    def run_pair(self, round_index: int, name: str, warm_up: bool = False) -> None:
        """Run workload ``name``'s pair of round ``round_index`` (its prompts' seed) and keep its ratios, or only
        print them when ``warm_up``."""
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
            # The feature runs: B once, or once at each ``--switch-intervals-ms`` interval.
            intervals = self.intervals or [None]
            runs = ["A", *intervals]
            stats = {}
            for run in (runs if round_index % 2 == 0 else runs[::-1]):
                if run == "A":
                    stats[run] = self.run(self.plain_url, prompts, stream, concurrency,
                                          sample_as=f"{round_index}-{name}-A")
                    continue
                suffix = "" if run is None else f"-{run:g}ms"
                if run is not None:
                    worker_call(self.interp_url, "interp_switch_interval", ms=run)
                    # B's runs of a pair share their prompts: a second one would find the first's blocks cached.
                    if not post(self.interp_url, "/reset_prefix_cache", {}).get("success"):
                        raise RuntimeError("vllm-interp's server did not reset its prefix cache between B's runs")
                stats[run] = self.run(self.interp_url, prompts, stream, concurrency, fields,
                                      sample_as=f"{round_index}-{name}-B{suffix}")
        finally:
            if name == "steer_global":
                post(self.interp_url, "/v1/steering/clear", {})
        peer = None
        if self.lens_url is not None and (lens_fields := self.lens_workload(name, seed)) is not None:
            peer = self.run(self.lens_url, prompts, stream, concurrency, lens_fields)
        baseline = stats["A"]
        if warm_up:
            print(f"warm-up {name}: {describe(baseline)} | {describe(stats[intervals[0]])}", flush=True)
            return
        for interval in intervals:
            label = name if interval is None else f"{name} @ {interval:g} ms"
            # The peer's run is compared once, on the first label, not repeated per interval.
            shown_peer = peer if interval == intervals[0] else None
            self.pairs.append((round_index, label, baseline, stats[interval], shown_peer))
            print(f"round {round_index} {label}: {describe(baseline)} | {describe(stats[interval])}"
                  + (f" | vllm-lens {describe(peer)}" if peer is not None else ""), flush=True)


def describe(stats: RunStats) -> str:
    ttft, tpot = stats.ttft_ms(), stats.tpot_ms()
    engine = " ".join(f"{label} {value:.1f}" for label, value in stats.engine_ms.items())
    return (f"ttft {fmt(ttft)} ms tpot {fmt(tpot)} ms latency {stats.latency_s():.2f} s "
            f"{stats.throughput():.0f} tok/s errors {stats.errors} ({engine} ms)")


def fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def ratio(feature: float | None, baseline: float | None) -> float | None:
    return None if feature is None or baseline is None or baseline == 0 else feature / baseline


def column_medians(rows: list[tuple[float | None, ...]]) -> list[float | None]:
    """The median of each column of ``rows`` over the rows that have a value there (None: none has)."""
    return [statistics.median(v) if (v := [r[k] for r in rows if r[k] is not None]) else None
            for k in range(len(rows[0]))]


def medians_with_ranges(rows: list[tuple[float | None, ...]]) -> list[str]:
    """Each column's median over rounds with its lowest and highest value, ``1.009 (0.880-1.132)``: a target
    inside the range of a workload whose requests use nothing (idle) is inside this host's noise."""
    cells = []
    for k, median in enumerate(column_medians(rows)):
        values = [r[k] for r in rows if r[k] is not None]
        cells.append(fmt(median, 3) + (f" ({min(values):.3f}-{max(values):.3f})" if len(values) > 1 else ""))
    return cells


def kv_cache_tokens(log: Path) -> str:
    """The KV cache size the server's engine reported (unequal caches would make the ratios measure queueing)."""
    match = re.search(r"GPU KV cache size: ([\d,]+) tokens", log.read_text(errors="replace"))
    return match.group(1) if match else "unknown"


def ratios_of(feature: RunStats, baseline: RunStats) -> tuple[float | None, ...]:
    """(TTFT, TPOT, throughput, latency) of ``feature`` over ``baseline``."""
    return (ratio(feature.ttft_ms(), baseline.ttft_ms()), ratio(feature.tpot_ms(), baseline.tpot_ms()),
            ratio(feature.throughput(), baseline.throughput()), ratio(feature.latency_s(), baseline.latency_s()))


def comparison_table(runs: list[tuple[int, str, RunStats, RunStats]], other: str, medians_title: str) -> list[str]:
    """Per run, plain vLLM (A) against ``other`` (B, or the peer C) and their ratios; then per workload the
    median of each ratio over rounds, with its range."""
    lines = [f"| round | workload | TTFT ms A / {other} | TPOT ms A / {other} | tok/s A / {other} | TTFT ratio | "
             f"TPOT ratio | throughput ratio | latency ratio | errors A / {other} |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    by_workload: dict[str, list[tuple[float | None, ...]]] = {}
    for round_index, name, a, x in runs:
        ratios = ratios_of(x, a)
        by_workload.setdefault(name, []).append(ratios)
        lines.append(f"| {round_index} | {name} | {fmt(a.ttft_ms())} / {fmt(x.ttft_ms())} | {fmt(a.tpot_ms(), 2)} / "
                     f"{fmt(x.tpot_ms(), 2)} | {a.throughput():.0f} / {x.throughput():.0f} | "
                     + " | ".join(fmt(r, 3) for r in ratios) + f" | {a.errors} / {x.errors} |")
    lines += ["", medians_title, "", "| workload | TTFT | TPOT | throughput | latency |", "|---|---|---|---|---|"]
    return lines + [f"| {name} | " + " | ".join(medians_with_ranges(rows)) + " |" for name, rows in by_workload.items()]


def report(bench: Bench, started: str, card: str, wall_s: float, kv_tokens: tuple[str, ...],
           profile_sections: list[str], rounds_done: int | None = None) -> str:
    """The report; ``rounds_done``: written while the run goes on, after that many of its rounds."""
    args = bench.args
    rounds = (f"{args.rounds} rounds" if rounds_done is None
              else f"{rounds_done} of {args.rounds} rounds so far (written after each round; the run went on)")
    lines = [f"# Serving: plain vLLM vs vllm-interp ({date.today().isoformat()})", "",
             f"- Card: {card}", f"- Model: `{args.model}` ({bench.layers} layers, hidden {bench.hidden})",
             f"- Requests: {args.requests} at concurrency {args.concurrency} ({args.requests_c1} one at a time for "
             f"idle_c1), {args.prompt_tokens} random prompt tokens, {args.max_tokens} generated (ignore_eos), greedy",
             f"- Model runner (both servers): {args.runner}; server args: `{' '.join(args.server_arg)}`",
             f"- KV cache: plain {kv_tokens[0]} tokens, vllm-interp {kv_tokens[1]} tokens"
             + (f", vllm-lens {kv_tokens[2]} tokens" if len(kv_tokens) > 2 else ""),
             f"- Started {started}; {rounds} after {args.warmup_rounds} warm-up (not reported), A (plain) "
             f"and B (vllm-interp) per workload, A first in even rounds and B first in odd ones; {wall_s:.0f} s",
             "", *comparison_table([(r, name, a, b) for r, name, a, b, _ in bench.pairs], "B",
                                   "Median over rounds (feature / baseline):")]
    lines += ["", "Where the time to the first token goes, mean ms per request (client; from each server's "
              "/metrics: engine TTFT, queue, prefill), A / B:", "",
              "| round | workload | client TTFT | engine TTFT | queue | prefill |", "|---|---|---|---|---|---|"]
    for round_index, name, a, b, _ in bench.pairs:
        if a.ttft_ms() is not None:
            cells = [f"{fmt(a.ttft_ms())} / {fmt(b.ttft_ms())}"]
            cells += [f"{fmt(a.engine_ms.get(k))} / {fmt(b.engine_ms.get(k))}" for k in ENGINE_METRICS]
            lines.append(f"| {round_index} | {name} | " + " | ".join(cells) + " |")
    lines += cpu_table(bench)
    lines += functions_table(bench)
    peer_rows = [(round_index, name, a, c) for round_index, name, a, _, c in bench.pairs if c is not None]
    if peer_rows:
        lines += ["", "## Peer: vllm-lens 1.2.1 (C; eager, V1 runner) against the same plain runs (A)", "",
                  *comparison_table(peer_rows, "C", "Median over rounds (vllm-lens / plain):")]
    if profile_sections:
        lines += ["", f"## A wave's first {PROFILE_STEPS} engine steps under the torch profiler (one more wave per "
                  "workload after the rounds, on each server; it slows the steps it records)", "", *profile_sections]
    return "\n".join(lines) + "\n"


def cpu_table(bench: Bench) -> list[str]:
    """Per run, the engine core's forward thread's time on a CPU and waiting for one, and how busy the host's
    CPUs were: a forward thread that waits for a CPU lengthens every step, whichever server it belongs to."""
    rows = [(r, name, a, b, clocks) for r, name, a, b, _ in bench.pairs
            if None not in (clocks := (a.forward_thread(), b.forward_thread()))]
    if not rows:
        return []
    pinned = f"clients pinned to CPUs {sorted(bench.client_cpus)}" if bench.client_cpus else "nothing pinned"
    lines = ["", f"The engine core's forward thread (`{ENGINE_CORE_THREAD}`) per run, ms on a CPU / ms waiting for "
             f"a CPU, and the host's CPUs in use ({pinned}), A / B:", "",
             "| round | workload | wall s | forward thread on a CPU ms | waiting for a CPU ms | host CPUs busy |",
             "|---|---|---|---|---|---|"]
    for round_index, name, a, b, ((a_ran, a_queued), (b_ran, b_queued)) in rows:
        lines.append(f"| {round_index} | {name} | {a.wall_s:.2f} / {b.wall_s:.2f} | {a_ran:.0f} / {b_ran:.0f} | "
                     f"{a_queued:.0f} / {b_queued:.0f} | {fmt(a.host_busy, 2)} / {fmt(b.host_busy, 2)} |")
    return lines


def functions_table(bench: Bench) -> list[str]:
    """``--function-timers``: per run, the milliseconds each timed engine function took (nested ones inside their
    callers), A / B, and the model forwards the run took (its steps)."""
    runs = [(r, name, a, b) for r, name, a, b, _ in bench.pairs if a.functions or b.functions]
    if not runs:
        return []
    labels = [label for label in map(function_timers.label_of, function_timers.FUNCTIONS)
              if any(run.functions.get(label, [0.0])[0] for _, _, a, b in runs for run in (a, b))]
    lines = ["", "Engine functions per run, ms (nested ones inside their callers), A / B:", "",
             "| function | " + " | ".join(f"{r}: {name}" for r, name, _, _ in runs) + " |",
             "|---|" + "---|" * len(runs)]
    for label in labels:
        cells = [" / ".join(f"{1000 * run.functions.get(label, [0.0])[0]:.1f}" for run in (a, b))
                 for _, _, a, b in runs]
        lines.append(f"| `{label}` | " + " | ".join(cells) + " |")
    cells = [" / ".join(f"{run.functions.get(function_timers.FORWARD, [0.0, 0])[1]:.0f}" for run in (a, b))
             for _, _, a, b in runs]
    lines.append("| model forwards (calls) | " + " | ".join(cells) + " |")
    return lines


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
    # Four waves at concurrency 128: runs of 8-13 s on an H200 host kept idle TPOT ratios within 0.94-0.99 over six
    # rounds, where runs of one or two waves (5-7 s) spread 0.89-1.27 (benchmarks/results/serve-gpu-2026-12-02.md).
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--requests-c1", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup-rounds", type=int, default=1, help="rounds first, left out of the report")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--runner", choices=("default", "v1"), default="default",
                        help="default: the one vLLM picks (V2 on GPUs); v1: VLLM_USE_V2_MODEL_RUNNER=0")
    parser.add_argument("--server-arg", action="append", default=[], help="passed to both servers (repeatable)")
    parser.add_argument("--start-timeout", type=float, default=600)
    parser.add_argument("--torch-profile", default="",
                        help=f"workloads ({', '.join(PROFILED)}) to run once more after the rounds under each "
                             "server's torch profiler, over the wave's first steps")
    parser.add_argument("--torch-profile-stack", action="store_true",
                        help="--torch-profile with Python calls recorded (torch's Python tracer; much slower steps)")
    parser.add_argument("--pin-cpus", action="store_true",
                        help="servers on the first half of the CPUs, the clients on the other half")
    parser.add_argument("--py-spy", default=None,
                        help="py-spy binary: sample each run's server (all its processes and threads, idle included)")
    parser.add_argument("--py-spy-gil", action="store_true", help="--py-spy: only threads holding the GIL")
    parser.add_argument("--switch-intervals-ms", default="",
                        help="run B at each of these engine switch intervals (ms, comma-separated), against one A")
    parser.add_argument("--function-timers", action="store_true",
                        help="time engine functions inside both servers' engine cores (a vLLM general plugin)")
    parser.add_argument("--peer-site", default=None,
                        help="directory holding vllm-lens and its dependencies: adds vllm-lens's server (C)")
    args = parser.parse_args()
    names = args.workloads.split(",")
    if unknown := sorted(set(names) - set(WORKLOADS)):
        parser.error(f"unknown workloads {unknown} (known: {', '.join(WORKLOADS)})")
    profiled = [name for name in args.torch_profile.split(",") if name]
    if unknown := sorted(set(profiled) - set(PROFILED)):
        parser.error(f"--torch-profile: unknown or unprofiled workloads {unknown} (these: {', '.join(PROFILED)})")
    config = json.loads((Path(args.model) / "config.json").read_text())
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    common = [args.model, "--max-model-len", str(args.prompt_tokens + args.max_tokens + 16), *args.server_arg]
    # Plain vLLM loads none of vllm-interp's plugins (they are visible to it through entry points).
    runner_env = {"VLLM_USE_V2_MODEL_RUNNER": "0"} if args.runner == "v1" else {}
    plain_env = {**os.environ, "VLLM_PLUGINS": "", **runner_env}
    interp_env = {**os.environ, **runner_env}
    timers = {}
    if args.function_timers:  # plain vLLM loads this one plugin; vllm-interp loads it beside its own
        plugin = function_timers.write_plugin(workdir / "function-timers-plugin")
        path = os.pathsep.join(filter(None, [str(plugin), str(Path(__file__).resolve().parents[1]),
                                             os.environ.get("PYTHONPATH")]))
        for name, env in (("plain", plain_env), ("interp", interp_env)):
            timers[name] = workdir / "function-timers" / name
            timers[name].mkdir(parents=True, exist_ok=True)
            for stale in timers[name].glob("*.json"):
                stale.unlink()
            env.update({"PYTHONPATH": path, function_timers.TIMERS_DIR: str(timers[name])})
        plain_env["VLLM_PLUGINS"] = function_timers.PLUGIN
    # vllm-lens loads as a general plugin wherever it is importable; only its own server sees it.
    lens_env = {**os.environ, "VLLM_PLUGINS": "activations",
                "PYTHONPATH": os.pathsep.join(filter(None, [args.peer_site, os.environ.get("PYTHONPATH")]))}
    interp_args = ["--enable-steering", "--max-steering-configs", str(max(args.concurrency, 8)), "--enable-patching",
                   "--capture-consumers", "inline", "--capture-consumers", f"filesystem:root={workdir / 'captures'}"]
    profiles = workdir / "profiles"

    def profiling(server: str) -> list[str]:
        return step_profile.profiler_args(profiles / server, args.torch_profile_stack, skip=0,
                                          window=PROFILE_STEPS) if profiled else []

    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    began = time.monotonic()
    plain_url, plain = launch_server([*common, *profiling("plain")], workdir / "plain.log", plain_env, VLLM_MODULE)
    intervals = [float(ms) for ms in args.switch_intervals_ms.split(",") if ms]
    dev_mode = {"VLLM_SERVER_DEV_MODE": "1"} if intervals else {}  # /collective_rpc sets the interval
    interp_url, interp = launch_server([*common, *interp_args, *profiling("interp")], workdir / "interp.log",
                                       {**interp_env, **dev_mode}, VLLM_INTERP_MODULE)
    servers = {"plain": (plain_url, plain), "interp": (interp_url, interp)}
    if args.peer_site:
        servers["lens"] = launch_server(common, workdir / "lens.log", lens_env, VLLM_MODULE)
    client_cpus = None
    if args.pin_cpus:  # still importing: every process and thread a server starts inherits its CPUs
        server_cpus, client_cpus = split_cpus()
        for _, process in servers.values():
            os.sched_setaffinity(process.pid, server_cpus)
    try:
        for name, (url, process) in servers.items():
            wait_healthy(url, process, workdir / f"{name}.log", args.start_timeout)
        print(f"servers ready after {time.monotonic() - began:.0f} s", flush=True)
        kv_tokens = tuple(kv_cache_tokens(workdir / f"{name}.log") for name in servers)
        card = gpu_card()  # for every report, the one written after each round and the last
        bench = Bench(args, plain_url, interp_url, config["num_hidden_layers"], config["hidden_size"],
                      config["vocab_size"], lens_url=servers["lens"][0] if "lens" in servers else None,
                      pids={url: process.pid for url, process in servers.values()},
                      timers={servers[name][0]: directory for name, directory in timers.items()},
                      client_cpus=client_cpus, py_spy=args.py_spy, py_spy_gil=args.py_spy_gil, intervals=intervals)
        warm_up = [bench.body(p) for p in bench.prompts(99, 2)]  # first requests pay one-off costs; not reported
        for url, _ in servers.values():
            run_requests(url, warm_up, 2)
        for extra in range(args.warmup_rounds):  # seeds past the measured rounds': prompts of their own
            for name in names:
                bench.run_pair(args.rounds + extra, name, warm_up=True)
        for round_index in range(args.rounds):
            for name in names:
                bench.run_pair(round_index, name)
            # A device call cut off by its time limit still returns the rounds it finished.
            Path(args.out).write_text(report(bench, started, card, time.monotonic() - began, kv_tokens, [],
                                             rounds_done=round_index + 1))
        profile_sections = [section for name in profiled for section in bench.profile_pair(name, profiles)]
    finally:
        for _, process in servers.values():
            stop_server(process)
    text = report(bench, started, card, time.monotonic() - began, kv_tokens, profile_sections)
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
