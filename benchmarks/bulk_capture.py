"""Bulk capture benchmark: every token at every layer's post_block, on one `vllm-interp serve`, interleaved with
requests that capture nothing.

    python -m benchmarks.bulk_capture MODEL --out FILE.md [--concurrency 64] [--prompt-tokens 256]
        [--max-tokens 256] [--requests 256] [--rounds 2] [--warmup-rounds 1] [--isolation process|thread]
        [--phases plain,logging_packed,...]
        [--py-spy PATH] [--torch-profile] [--profile-steps 30:40] [--disk-mb 2048] [--disk-only]
        [--switch-intervals-ms 5,0.5] [--pin-cpus]
        [--server-arg=--enforce-eager ...]

One server with the ``logging`` consumer and the ``filesystem`` consumer (``layout=sharded``), each where it
runs by default (``logging`` on a worker thread, ``filesystem`` in its own process; ``--isolation`` puts both
in one place, for comparison).
Every round runs, with the same number of fresh prompts each:
``plain`` (no capture: the baseline), ``logging`` (every position, ``post_block`` of every layer, to the
logging consumer), ``logging_packed`` (the same, its statistics returned as one base64 float32 block instead
of JSON lists), ``logging_packed_layer0`` (the same at layer 0's ``post_block`` alone: the per-step and
per-request work is the same as at every layer, the rows and the device's work a sixteenth of a 16-layer
model's, so the two phases together split the cost between what grows with the sites and what does not),
``logging_packed_once`` (layer 0's ``post_block`` at the last prompt position alone: every request is admitted,
finished, handed to its consumer and its results awaited as in the phases above, but no decode step reads, so it
splits the cost of a capturing request from that of a capturing step),
``plain_after`` (sent the moment the burst's last stream ends, while its consumer may still
work through the backlog), ``sink`` (the same capture to the sharded filesystem layout, which takes each request
in parts while it runs), ``plain_after_sink``, ``sink_whole`` (the sink with ``part_mb: 0``: each request
whole, when it ends). ``plain`` runs first in every round; odd rounds run the bursts in reverse order (each
still followed by its ``plain_after``): ``round_order``.
``--warmup-rounds`` rounds run first: the first bursts pay one-off costs (the pinned arena and torch's pinned
cache filling, the consumer's shared blocks mapped, a sink burst on an H200 host at 0.30 of
plain in its first round and 0.46-0.66 in the next three), so they are listed but left out of the medians.
Reported: throughput and TPOT of each phase against ``plain`` of the same round, TTFT of the plain phases after a burst
against that ``plain`` (run before the bursts), each capturing phase's throughput against the mean of the plain phases
right before and after it too (``bracketed_section``: the host's drift within a round cancelled), the bytes of rows each
capturing phase captured and their rate, how many steps the engine ran and how many of them replayed a CUDA graph, the
engine core's forward thread's time on a CPU per step, how its capturing steps read (inside replayed CUDA graphs or
eagerly, and how many as a steady batch's), how many asks for capture results the worker answered (every API server
polls for its own streams) and in how many ms of its forward thread (the worker's ``interp_capture_steps``, through
vLLM's dev-mode ``/collective_rpc``, which the server is started with), how many blocks torch's pinned cache pinned
afresh during the phase (and the ms that took) and unpinned, how many blocks of memory the consumers' hosts made for
requests' rows instead of reusing a spare one, the engine process's garbage collections per generation and their time
(``engine/gc_clock.py``: a collection pauses whichever thread allocated last, the forward thread mostly), the bytes of
the sink's shards (each sink phase's deleted once counted, so that long runs fit the disk), the server processes' peak
resident memory, the server's busiest threads' time on a CPU and waiting for one in each phase (Linux's scheduler
statistics: a forward thread that is neither is blocked, on a lock, the device or I/O; a lone thread busy 90% of a phase
or more is named as its limit: with one API server at 64 streams, its event loop, already in ``plain``;
``--server-arg=--api-server-count --server-arg=4`` spreads it), and, on the capture root's disk, the rate of the sink's
own shard writer against a plain sequential write of the same bytes (A B A B, each synced to disk); ``--disk-only``
measures only that, without a server.

``--switch-intervals-ms A,B,...`` runs every round once at each of these Python switch intervals in the engine's
process (set on the running server between the runs, through the worker's ``interp_switch_interval``; the
intervals in reverse order in odd rounds), each with its own ``plain``: the report's ratios and medians are per
interval, so drift falls on each alike.

``--pin-cpus`` runs the server (every process it starts) on half of the host's cores and the clients on the
other half, each core's hardware threads on one side (``serving.split_cpus``): the clients' parsing and the
server's forward thread then never share a core.

``--py-spy PATH`` (a py-spy binary) samples every thread of the server's processes (the API server, the engine
core, a consumer's own process) during each phase, plain included, idle time included (``--py-spy-gil``
instead: only the thread holding each process's interpreter lock), into ``py-spy-<round>-<phase>.txt`` beside ``--out``
(collapsed stacks, one line per distinct stack). (With
``--native`` added, py-spy 0.4.3 wrote nothing on the H200 host: not offered.)

``--torch-profile`` runs vLLM's torch profiler over a window of decode steps of every phase, plain included
(``benchmarks/step_profile.py``), and adds each phase's device time per step, by kernel, and the forward
thread's CUDA calls to the report; ``--torch-profile-stack`` also records Python calls (torch's Python tracer)
and adds the time per step of vllm-interp's own functions; ``--profile-steps SKIP:STEPS`` moves the window
(default 30:40, decode steps; ``0:300`` a whole burst of 256-token requests, prefill and end included). The
profiler slows the steps it records (the Python tracer much more): that run's throughput figures are not
comparable with others'.
"""

import argparse
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch

from benchmarks import step_profile
from benchmarks.consumer_handoff import plain_write_mb_s
from benchmarks.serve import (
    RESULTS_METRICS,
    RunStats,
    fmt,
    gpu_card,
    medians_with_ranges,
    ratio,
    run_requests,
    worker_call,
)
from benchmarks.serving import (
    VLLM_INTERP_MODULE,
    ServerSampler,
    launch_server,
    process_label,
    server_rss_mb,
    split_cpus,
    stop_server,
    wait_healthy,
)
from vllm_interp.capture.consumer import CaptureMeta, ConsumerContext, RequestCapture
from vllm_interp.capture.consumers.filesystem import FilesystemConsumer
from vllm_interp.capture.spec import ConsumerSpec

PHASES = ("plain", "logging", "logging_packed_once", "logging_packed", "logging_packed_layer0", "plain_after", "sink",
          "plain_after_sink", "sink_whole")
EVERY_TOKEN = {"hooks": {"post_block": "all"}, "positions": "all"}
# Each capturing phase's ``capture`` field.
CAPTURES = {"logging": {"logging": EVERY_TOKEN}, "logging_packed": {"logging": {**EVERY_TOKEN, "format": "packed"}},
            "logging_packed_layer0": {"logging": {"hooks": {"post_block": [0]}, "positions": "all",
                                                  "format": "packed"}},
            "logging_packed_once": {"logging": {"hooks": {"post_block": [0]}, "positions": "last_prompt",
                                                "format": "packed"}},
            "sink": {"filesystem": EVERY_TOKEN}, "sink_whole": {"filesystem": {**EVERY_TOKEN, "part_mb": 0}}}


def captured_sites(capture: dict, layers: int) -> int:
    """How many sites a phase's ``capture`` field reads on a model of ``layers`` layers."""
    (spec,) = capture.values()
    return len(ConsumerSpec.model_validate(spec).sites(layers))


def captured_positions(capture: dict, prompt_tokens: int, max_tokens: int) -> int:
    """How many positions of a request a phase's ``capture`` field reads: the last prompt one, or every one that
    goes through the model (all but the last generated)."""
    (spec,) = capture.values()
    return 1 if spec["positions"] == "last_prompt" else prompt_tokens + max_tokens - 1


@dataclass
class Phase:
    round_index: int
    name: str
    stats: RunStats
    captured_bytes: int = 0  # rows x hidden x dtype size of every capturing request
    steps: dict[str, float] | None = None  # how its capturing steps read, pinned counts (``capture_steps``)
    interval_ms: float | None = None  # the engine's switch interval over the phase (``--switch-intervals-ms``)

    @property
    def label(self) -> str:
        return self.name if self.interval_ms is None else f"{self.name} @ {self.interval_ms:g} ms"


def step_counts(phase: Phase, *keys: str, digits: int = 1) -> str:
    """A report cell of the phase's ``interp_capture_steps`` counts, ``a / b / c``; ``-`` where the worker did
    not report them (the first key missing: a count the worker's tree did not have yet, or pinned memory off
    the GPU)."""
    counts = phase.steps
    return " / ".join(fmt(counts[k], digits) for k in keys) if counts and keys[0] in counts else "-"


def forward_ms_per_step(phase: Phase) -> float | None:
    """The engine core's forward thread's time on a CPU per step of the phase: what a step's host work costs,
    on the thread that bounds the step when the host does (on an H100 host it was on a CPU 91-95% of every
    phase, plain included), apart from the clients' and API servers' share of the throughput's noise."""
    clocks, steps = phase.stats.forward_thread(), (phase.steps or {}).get("steps")
    return clocks[0] / steps if clocks is not None and steps else None


def results_timeline(phase: Phase) -> str:
    """A report cell of the worker's mean ms per answered request, from its end to its rows handed on, to its
    consumers done, to the answer that took them (``CaptureStore.results_timeline``); ``-`` where none."""
    counts = phase.steps or {}
    answered = counts.get("results_answered")
    if not answered:
        return "-"
    return " / ".join(fmt(counts[f"results_{stage}_ms"] / answered) for stage in ("land", "consume", "claim"))


def round_order(names: list[str], round_index: int) -> list[str]:
    """The phases of a round: ``plain`` first (the baseline that the plain phases after a burst are held to),
    then the bursts as listed in even rounds and in reverse in odd ones, each ``plain_after*`` phase kept right
    after the burst it follows: no burst always runs right after another's backlog."""
    units: list[list[str]] = []
    for name in names:
        if name.startswith("plain_after") and units:
            units[-1].append(name)
        else:
            units.append([name])
    plain, bursts = units[0], units[1:]
    ordered = [plain, *(bursts if round_index % 2 == 0 else bursts[::-1])]
    return [name for unit in ordered for name in unit]


class RssWatch(threading.Thread):
    """Samples the resident memory of a server's process tree once a second; keeps each process's peak."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.peak: dict[str, float] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(1.0):
            try:
                # Labelled as the threads' table labels them: the consumers' child processes are all named python3.
                rss = server_rss_mb(self.pid, lambda p: f"{process_label(p)} ({p.pid})")
            except psutil.Error:
                continue
            for name, mb in rss.items():
                self.peak[name] = max(self.peak.get(name, 0.0), mb)


def capture_steps(url: str) -> dict[str, float]:
    """The worker's counts of capturing steps and pinned blocks so far (rank 0's: every rank reads the same
    rows)."""
    return worker_call(url, "interp_capture_steps")


def dtype_size(config: dict[str, Any], server_args: list[str]) -> int:
    """Bytes per element of the served model's activations: ``--dtype`` if given, else the checkpoint's."""
    given = [a.split("=", 1)[1] for a in server_args if a.startswith("--dtype=")]
    given += [b for a, b in zip(server_args, server_args[1:], strict=False) if a == "--dtype"]
    name = given[-1] if given and given[-1] != "auto" else config.get("torch_dtype") or config.get("dtype")
    return 4 if name in ("float32", "float") else 2


def published_shards(root: Path) -> list[Path]:
    """The sink's published shards under ``root`` (one still being written has its temporary name)."""
    return list((root / "shards").glob("shard-*.safetensors"))


def shard_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in published_shards(root))


def drop_shards(root: Path) -> int:
    """Delete the sink's published shards (the bytes they held): 256 requests of a sink phase write 8.6 GB, so
    a run of several rounds would fill the device's disk. A shard still being written stays; the consumer
    numbers its shards once, at start, so it never reuses a deleted one's name."""
    dropped = 0
    for shard in published_shards(root):
        dropped += shard.stat().st_size
        shard.unlink()
    return dropped


PLAIN_CHUNK = 64 << 20  # the plain write's bytes per call


def disk_rates(root: Path, total_mb: int, hidden: int, layers: int, rounds: int) -> list[tuple[float, float]]:
    """(sink MB/s, plain MB/s) per round on ``root``'s disk: the sharded filesystem consumer writing captures of
    256 positions x ``layers`` sites against one sequential write of the same bytes, both synced."""
    positions = 256
    per_request = positions * layers * hidden * 2
    count = max(1, (total_mb << 20) // per_request)
    tensors = {f"{layer}.post_block": torch.randn(positions, hidden).to(torch.bfloat16) for layer in range(layers)}
    rates = []
    for round_index in range(rounds):
        directory = Path(tempfile.mkdtemp(dir=root, prefix=f"disk-{round_index}-"))
        options = FilesystemConsumer.validate_engine_options({"root": str(directory / "sink"), "layout": "sharded"})
        consumer = FilesystemConsumer(ConsumerContext("filesystem", options, "m", layers, hidden))
        started = time.perf_counter()
        for i in range(count):
            meta = CaptureMeta(request_id=f"r{i}", tag=None, model="m", prompt_len=positions,
                               positions=list(range(positions)), sites=list(tensors), dtype="bfloat16")
            consumer.consume(RequestCapture(meta, tensors))
        consumer.close()
        sink_s = time.perf_counter() - started
        written = shard_bytes(directory / "sink")
        chunk = memoryview(bytearray(PLAIN_CHUNK))
        plain = plain_write_mb_s(str(directory), -(-written // PLAIN_CHUNK) * PLAIN_CHUNK, chunk)
        rates.append((written / sink_s / 1e6, plain))
        shutil.rmtree(directory)
    return rates


def report(args: argparse.Namespace, phases: list[Phase], rates: list[tuple[float, float]],
           rss: dict[str, float], layers: int, hidden: int, started: str, wall_s: float, on_disk: int,
           rounds_done: int | None = None) -> str:
    """The report; ``rounds_done``: written while the run goes on, after that many rounds (warm-up included),
    before the server stops and the disk is measured."""
    lines = [f"# Bulk capture: every token, every layer ({time.strftime('%Y-%m-%d')})", "",
             f"- Card: {gpu_card()}", f"- Model: `{args.model}` ({layers} layers, hidden {hidden})",
             f"- Per phase: {args.requests} streaming requests at concurrency {args.concurrency}, "
             f"{args.prompt_tokens} random prompt tokens, {args.max_tokens} generated (ignore_eos), greedy",
             f"- Capture: `{json.dumps(EVERY_TOKEN)}` to `logging:level=debug` and to `filesystem` "
             f"(`layout=sharded,queue_mb={args.sink_queue_mb}`), isolation {args.isolation or 'each its default'}"
             + ("; `logging_packed_layer0` at layer 0 alone"
                if any(p.name == "logging_packed_layer0" for p in phases) else "")
             + ("; `logging_packed_once` at layer 0's last prompt position alone"
                if any(p.name == "logging_packed_once" for p in phases) else ""),
             f"- Server args: `{' '.join(args.server_arg)}`; started {started}; {wall_s:.0f} s"
             + (f"; written after {rounds_done} rounds (warm-up included) while the run went on: no disk rates, "
                "no shards counted" if rounds_done is not None else "")
             + ("; server and clients pinned to separate cores" if args.pin_cpus else ""),
             "- `plain` first in every round, then the bursts in the order listed in even rounds and in reverse in odd "
             "ones (a burst's `plain_after` right after it)"
             + (f"; each round at engine switch intervals {args.switch_intervals_ms} ms, in reverse order in odd "
                "rounds, each with its own `plain`" if args.switch_intervals_ms else ""), "",
             "(last gap: the median wait for a stream's last text chunk, which a capturing stream holds until the "
             "request's capture results come; TPOT includes it. Results wait / prepare: the server's mean per "
             "capturing request, from vLLM's last output to the results reaching the API server, then their "
             "unpacking and conversion there; `vllm_interp/server/metrics.py`. Worker's results timeline: its "
             "mean per answered request, from the request's end there to its rows landed and handed on, to its "
             "consumers done, to the poll that took them)", "",
             "| round | phase | TTFT ms | TPOT ms | last gap ms | results wait / prepare ms | tok/s | "
             "throughput / plain | TPOT / plain | TTFT / plain | captured MB | captured MB/s | "
             "steps / replayed | forward thread ms on a CPU / step | capturing steps graph / eager / steady | "
             "results asks / ms | worker's results timeline ms landed / consumed / claimed | "
             "pinned afresh / ms / unpinned | rows' blocks made | "
             "engine GC collections gen 0 / 1 / 2 | engine GC ms gen 0 / 1 / 2 | errors |",
             "|" + "---|" * 22]
    summary: dict[str, list[tuple[float | None, ...]]] = {}
    for phase in phases:  # warm-up rounds (negative) are listed, not summarised
        base = next(p.stats for p in phases if p.round_index == phase.round_index and p.name == "plain"
                    and p.interval_ms == phase.interval_ms)
        s = phase.stats
        ratios = (ratio(s.throughput(), base.throughput()), ratio(s.tpot_ms(), base.tpot_ms()),
                  ratio(s.ttft_ms(), base.ttft_ms()))
        if phase.round_index >= 0:
            summary.setdefault(phase.label, []).append(ratios)
        captured = phase.captured_bytes / 1e6
        sink = f"{captured:.0f} | {captured / s.wall_s:.0f}" if captured else "- | -"
        results = " / ".join(fmt(s.engine_ms.get(label)) for label in RESULTS_METRICS)
        steps = step_counts(phase, "graph", "eager", "steady", digits=0)
        pinned = step_counts(phase, "pinned", "pinned_ms", "unpinned")
        made = step_counts(phase, "blocks_made", digits=0)
        collections = step_counts(phase, "gc0", "gc1", "gc2", digits=0)
        collector_ms = step_counts(phase, "gc0_ms", "gc1_ms", "gc2_ms")
        steps_run = step_counts(phase, "steps", "replayed", digits=0)
        per_step = forward_ms_per_step(phase)
        asks = step_counts(phase, "results_asks", "results_ms", digits=0)
        label = phase.round_index if phase.round_index >= 0 else "warm-up"
        lines.append(f"| {label} | {phase.label} | {fmt(s.ttft_ms())} | {fmt(s.tpot_ms(), 2)} | "
                     f"{fmt(s.last_gap_ms())} | {results} | {s.throughput():.0f} | "
                     + " | ".join(fmt(r, 3) for r in ratios)
                     + f" | {sink} | {steps_run} | {fmt(per_step, 2)} | {steps} | {asks} | {results_timeline(phase)} | "
                       f"{pinned} | {made} | "
                       f"{collections} | {collector_ms} | {s.errors} |")
    lines += ["", "Median over rounds (against `plain` of the same round):", "",
              "| phase | throughput | TPOT | TTFT |", "|---|---|---|---|"]
    for name, rows in summary.items():
        lines.append(f"| {name} | " + " | ".join(medians_with_ranges(rows)) + " |")
    lines += bracketed_section(phases)
    captured = sum(p.captured_bytes for p in phases if p.name.startswith("sink"))
    lines += ["", f"The sink's shards: {on_disk / 1e6:.0f} MB published by shutdown (its phases captured "
              f"{captured / 1e6:.0f} MB of rows; a shard still buffered is published when the server stops; "
              "published shards are deleted after each sink phase, once counted).", ""]
    lines += disk_section(rates)
    lines += sink_against_disk(phases, rates)
    lines += threads_section(phases)
    lines += ["", "Peak resident memory of the server's processes (MiB):", "", "| process | peak RSS |", "|---|---|"]
    lines += [f"| `{name}` | {mb:.0f} |" for name, mb in sorted(rss.items(), key=lambda kv: -kv[1])[:8]]
    return "\n".join(lines) + "\n"


def bracketed_section(phases: list[Phase]) -> list[str]:
    """Each capturing phase's throughput against the mean of the plain phases run right before and right after
    it (``phases`` in the order they ran, warm-up rounds included as neighbours). The host's own speed drifts
    within a call (an H100 host's ``plain`` forward thread took 2.64-3.32 ms a step in three rounds of one call,
    session 42), so a ratio to the round's first phase alone moves with wherever the drift happens to be; the
    mean of both neighbours cancels a steady drift. The phase after a burst may still carry its backlog (which
    ``plain_after`` exists to measure), so this flatters a burst that slows its successor: beside the primary
    ratio, never instead of it. Beside it, the forward thread's time on a CPU a step over theirs (ms), where
    measured: on a host-bound engine the cost the ratio comes from."""
    rows: dict[str, list[float]] = {}
    extra: dict[str, list[float]] = {}
    for before, phase, after in zip(phases, phases[1:], phases[2:], strict=False):
        if (phase.round_index >= 0 and phase.captured_bytes and not before.captured_bytes
                and not after.captured_bytes and phase.interval_ms == before.interval_ms == after.interval_ms):
            plain = (before.stats.throughput() + after.stats.throughput()) / 2
            rows.setdefault(phase.label, []).append(phase.stats.throughput() / plain)
            forward = [forward_ms_per_step(p) for p in (before, phase, after)]
            if None not in forward:
                extra.setdefault(phase.label, []).append(forward[1] - (forward[0] + forward[2]) / 2)
    if not rows:
        return []
    lines = ["", "Throughput against the mean of the plain phases right before and after (drift cancelled, a "
                 "burst's backlog in the phase after it not: see `bracketed_section`), and the forward thread's "
                 "ms on a CPU a step over theirs:", "",
             "| phase | by round | median | forward thread ms / step over them, by round | median |",
             "|---|---|---|---|---|"]
    for name, values in rows.items():
        more = extra.get(name, [])
        lines.append(f"| {name} | {', '.join(f'{r:.3f}' for r in values)} | {statistics.median(values):.3f} | "
                     f"{', '.join(f'{d:+.2f}' for d in more) or '-'} | "
                     f"{f'{statistics.median(more):+.2f}' if more else '-'} |")
    return lines


def sink_against_disk(phases: list[Phase], rates: list[tuple[float, float]]) -> list[str]:
    """Each measured sink phase's rate of rows while serving against the median plain write (issue 12's
    measure: the sink at >= 0.9 of a plain sequential write)."""
    sinks = [p for p in phases if p.name == "sink" and p.round_index >= 0 and p.captured_bytes]
    if not sinks or not rates:
        return []
    plain = statistics.median(rate for _, rate in rates)
    lines = []
    for label in dict.fromkeys(p.label for p in sinks):
        shares = [p.captured_bytes / 1e6 / p.stats.wall_s / plain for p in sinks if p.label == label]
        lines += ["", f"`{label}` while serving against the median plain write ({plain:.0f} MB/s): "
                  + ", ".join(f"{share:.2f}" for share in shares)
                  + f" by round; median {statistics.median(shares):.2f}."]
    return lines


BUSY_SHARE = 0.9  # a lone thread on a CPU this share of a phase or more is what the phase's rate waits on


def threads_section(phases: list[Phase], shown: int = 8) -> list[str]:
    """Per phase, the server's busiest threads: the median over the measured rounds of their time on a CPU and
    waiting for one, against the phase's wall time (what is neither, a thread spent blocked or idle), and the
    lone threads busy ``BUSY_SHARE`` of it or more: an API server's event loop there means the phase measured
    the API server (one API server at 64 streams: 93% busy serving plain requests on an H100 host)."""
    measured = [p for p in phases if p.round_index >= 0 and p.stats.threads]
    if not measured:
        return []
    lines = ["", "The server's threads in each phase, medians over the rounds (ms on a CPU / ms waiting for a CPU; "
             "the rest of the phase's wall a thread was blocked or idle; `/proc/<pid>/task/<tid>/schedstat`):", "",
             "| phase | wall ms | thread (threads of that name) | on a CPU ms | waiting for a CPU ms |",
             "|---|---|---|---|---|"]
    busy = []
    for name in dict.fromkeys(p.label for p in measured):
        rounds = [p for p in measured if p.label == name]
        wall = statistics.median(p.stats.wall_s * 1e3 for p in rounds)
        by_label = {label: [p.stats.threads.get(label, (0, 0.0, 0.0)) for p in rounds]
                    for label in {label for p in rounds for label in p.stats.threads}}
        medians = {label: (max(n for n, _, _ in clocks), statistics.median(ran for _, ran, _ in clocks),
                           statistics.median(queued for _, _, queued in clocks))
                   for label, clocks in by_label.items()}
        for label, (threads, ran, queued) in sorted(medians.items(), key=lambda kv: -kv[1][1])[:shown]:
            lines.append(f"| {name} | {wall:.0f} | `{label}` ({threads}) | {ran:.0f} | {queued:.0f} |")
        busy += [f"{name}: `{label}` {ran / wall:.0%}" for label, (threads, ran, _) in medians.items()
                 if threads == 1 and ran >= BUSY_SHARE * wall]
    return lines + ["", f"Lone threads on a CPU {BUSY_SHARE:.0%} of a phase or more (its limit): "
                    + ("; ".join(busy) if busy else "none") + "."]


def disk_section(rates: list[tuple[float, float]]) -> list[str]:
    lines = ["Disk, on the capture root (shard writer vs one plain sequential write of the same bytes, synced):",
             "", "| round | shard writer MB/s | plain write MB/s | ratio |", "|---|---|---|---|"]
    return lines + [f"| {i} | {sink:.0f} | {plain:.0f} | {sink / plain:.3f} |" for i, (sink, plain) in enumerate(rates)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model")
    parser.add_argument("--out", required=True)
    parser.add_argument("--workdir", default="/tmp/vllm-interp-bulk-bench")
    parser.add_argument("--concurrency", type=int, default=64)
    # Four requests per stream: at one each (64), a sink phase's 2.1 GB fitted in the consumer's queue and was
    # answered before it reached the disk, so the phase measured the queue, not the sink's sustained rate.
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup-rounds", type=int, default=1, help="rounds first, left out of the medians")
    parser.add_argument("--isolation", choices=("process", "thread"), help="both consumers' (default: each its own)")
    parser.add_argument("--disk-mb", type=int, default=2048, help="bytes per disk-rate round")
    # A burst's first parts come together: each request's prompt rows (16 MB for 256 positions at 16 sites of a
    # 2048-wide bf16 model, 1 GB for 64 requests). docs/capture.md: give queue_mb room for a burst.
    parser.add_argument("--sink-queue-mb", type=int, default=2048, help="the filesystem consumer's queue_mb")
    parser.add_argument("--disk-only", action="store_true", help="only the disk rates (no server)")
    parser.add_argument("--server-arg", action="append", default=[], help="passed to the server (repeatable)")
    parser.add_argument("--start-timeout", type=float, default=600)
    parser.add_argument("--phases", default=",".join(PHASES), help="which of the phases to run (plain always)")
    parser.add_argument("--switch-intervals-ms", default="",
                        help="run every round at each of these engine switch intervals (ms, comma-separated)")
    parser.add_argument("--pin-cpus", action="store_true",
                        help="the server on half of the cores, the clients on the other half")
    parser.add_argument("--py-spy", default=None, help="py-spy binary: sample the server's processes in every phase")
    parser.add_argument("--py-spy-gil", action="store_true", help="--py-spy: only threads holding the GIL")
    parser.add_argument("--torch-profile", action="store_true", help="device time per step of each phase, by kernel")
    parser.add_argument("--torch-profile-stack", action="store_true",
                        help="--torch-profile with Python calls: vllm-interp's own functions' time per step")
    parser.add_argument("--profile-steps", default=f"{step_profile.SKIP_STEPS}:{step_profile.WINDOW_STEPS}",
                        help="--torch-profile's window, SKIP:STEPS (0:300 covers a whole burst, prefill included)")
    args = parser.parse_args()
    asked = args.phases.split(",")
    unknown = set(asked) - set(PHASES)
    if unknown:
        parser.error(f"--phases: unknown {sorted(unknown)} (known: {', '.join(PHASES)})")
    phase_names = [name for name in PHASES if name == "plain" or name in asked]
    intervals: list[float | None] = [float(ms) for ms in args.switch_intervals_ms.split(",") if ms] or [None]
    config = json.loads((Path(args.model) / "config.json").read_text())
    layers, hidden, vocab = config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]
    itemsize = dtype_size(config, args.server_arg)
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    if args.disk_only:
        text = "\n".join(disk_section(disk_rates(workdir, args.disk_mb, hidden, layers, args.rounds))) + "\n"
        Path(args.out).write_text(text)
        print(text)
        return
    root = workdir / "captures"
    shutil.rmtree(root, ignore_errors=True)  # an earlier run's shards would count as this one's
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    began = time.monotonic()
    isolation = f",isolation={args.isolation}" if args.isolation else ""
    profiles = workdir / "profiles"
    args.torch_profile = args.torch_profile or args.torch_profile_stack
    skip, window = (int(n) for n in args.profile_steps.split(":"))
    profiling = step_profile.profiler_args(profiles, args.torch_profile_stack, skip, window) if args.torch_profile \
        else []
    profile_sections: list[str] = []
    url, server = launch_server(
        [args.model, "--max-model-len", str(args.prompt_tokens + args.max_tokens + 16), *args.server_arg, *profiling,
         "--capture-consumers", f"logging:level=debug{isolation}",
         "--capture-consumers", f"filesystem:root={root},layout=sharded,queue_mb={args.sink_queue_mb}{isolation}"],
        workdir / "server.log", {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}, VLLM_INTERP_MODULE)
    client_cpus = None
    if args.pin_cpus:  # still importing: every process and thread the server starts inherits its CPUs
        server_cpus, client_cpus = split_cpus()
        os.sched_setaffinity(server.pid, server_cpus)
    phases: list[Phase] = []
    dropped = 0  # bytes of the shards deleted between phases
    try:
        wait_healthy(url, server, workdir / "server.log", args.start_timeout)
        print(f"server ready after {time.monotonic() - began:.0f} s", flush=True)
        watch = RssWatch(server.pid)
        watch.start()
        rng = torch.Generator().manual_seed(0)
        out_dir = Path(args.out).parent
        sampler = ServerSampler(args.py_spy, server.pid, out_dir, args.py_spy_gil) if args.py_spy else None

        def body(capture: dict[str, Any] | None) -> dict[str, Any]:
            prompt = torch.randint(100, vocab - 100, (args.prompt_tokens,), generator=rng).tolist()
            fields = {"capture": capture} if capture else {}
            return {"model": args.model, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0,
                    "ignore_eos": True, "stream": True, **fields}

        run_requests(url, [body(None) for _ in range(2)], 2, client_cpus=client_cpus)  # the first ones pay one-offs
        for round_index, interval in (
                (r, interval) for r in range(-args.warmup_rounds, args.rounds)
                for interval in (intervals if r % 2 == 0 else intervals[::-1])):
            if interval is not None:
                now = worker_call(url, "interp_switch_interval", ms=interval)
                print(f"round {round_index}: the engine's switch interval is {now} ms", flush=True)
            for name in round_order(phase_names, round_index):
                capture = CAPTURES.get(name)
                bodies = [body(capture) for _ in range(args.requests)]
                tag = name if interval is None else f"{name}-{interval:g}ms"
                if sampler:
                    sampler.start(f"{round_index}-{tag}")
                if args.torch_profile:
                    since = time.time()
                    step_profile.post(url, "/start_profile")
                steps_before = capture_steps(url)
                stats = run_requests(url, bodies, args.concurrency, server.pid, client_cpus)
                steps = {k: n - steps_before.get(k, 0) for k, n in capture_steps(url).items()}
                if sampler:
                    sampler.stop()
                if args.torch_profile:
                    step_profile.post(url, "/stop_profile")
                    profile_sections.append(step_profile.summarise(step_profile.traces_since(profiles, since),
                                                                   f"round {round_index} {tag}", window))
                rows = (len(stats.ok) * captured_positions(capture, args.prompt_tokens, args.max_tokens)
                        * captured_sites(capture, layers) if capture else 0)
                phases.append(Phase(round_index, name, stats, rows * hidden * itemsize, steps, interval))
                if name.startswith("sink"):
                    dropped += drop_shards(root)
                print(f"round {round_index} {tag}: ttft {fmt(stats.ttft_ms())} ms tpot {fmt(stats.tpot_ms(), 2)} ms "
                      f"last gap {fmt(stats.last_gap_ms())} ms "
                      f"{stats.throughput():.0f} tok/s errors {stats.errors} capturing steps {steps}", flush=True)
                for error in sorted({s.error for s in stats.samples if s.error is not None}):
                    print(f"  error: {error}", flush=True)
            # A device call cut off by its time limit still returns the rounds it finished.
            rounds_done = len({phase.round_index for phase in phases})
            Path(args.out).write_text(report(args, phases, [], watch.peak, layers, hidden, started,
                                             time.monotonic() - began, 0, rounds_done=rounds_done))
        watch.stop.set()
    finally:
        stop_server(server)
    on_disk = dropped + shard_bytes(root)  # the sink's shards once the server (and its consumer) closed
    rates = disk_rates(workdir, args.disk_mb, hidden, layers, args.rounds)
    text = report(args, phases, rates, watch.peak, layers, hidden, started, time.monotonic() - began, on_disk)
    if profile_sections:
        text += ("\n## Device time per step (torch profiler; it slows the steps it records)\n\n"
                 + "\n".join(profile_sections))
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
