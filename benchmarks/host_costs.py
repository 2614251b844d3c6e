"""Host-side costs per step and per request, without an engine: what vllm-interp's Python adds where vLLM waits.

    python -m benchmarks.host_costs [--requests 64] [--layers 16] [--hidden 2048] [--repeats 2000] [--device cpu]
        [--only eager_site,every_token]

- Capture planning for one decode step of ``--requests`` requests that each read every position (``all``) or
  every generated one (``all_generated``) at ``post_block`` of every layer: ``CaptureStore.plan_reads`` and
  ``site_reads``, as the runner calls them before every step.
- A wave of ``--requests`` requests capturing ``last_prompt`` at every site to ``inline``: the worker's forward
  thread's share per request (admission, the prefill step's plan and collect, the finish that hands each to
  its consumer), and the time until every result is in (the consumer's runner thread's share added).
- The runner's whole plan of a decode step (``InterpSteps._interp_plan``) on an engine with steering, patching
  and capture enabled, for a batch of which no request uses them and for one of which every request has its
  own all-layer steering config.
- One HTTP request's work on the API server (``api_server_ms``): an all-layer steered request's JSON parse, its
  validation and payload (``InterpFrontend.prepare``), the middleware's whole rewrite of its body, and the
  worker's decoding of the payload when the request is admitted (``SteeringVectors.from_wire``); a request
  capturing ``last_prompt`` at every site to ``inline``: its rewrite, and its result's way back as JSON; one
  token's event of a capturing stream through the middleware (microseconds).
- The worker admitting a request whose all-layer steering config is new (its table rows written), per config;
  ``--device cuda`` puts that table on the GPU (host time, uploads included).
- The site op's eager body at every site of an 8,192-token prefill step, per call: idle, and reading a row per
  request finishing its prompt; with ``--device cuda`` (the stream on the GPU, launches included) also steering
  every row, and the steering add's two forms alone (the site kernel's launch, ``index_select`` + ``add_``).
- A forward-like loop beside an ``inline`` consumer's runner thread busy with 32 requests: the interpreter
  lock's handoffs, with the forward gate open and closed (``capture.dispatch.FORWARD``), at Python's default
  switch interval and at 0.5 ms (``--engine-switch-interval-ms``).
- Every-token capture of ``--requests`` requests at ``post_block`` of every layer to ``logging`` (packed), and
  to a sink that takes them in parts of 8 MiB and keeps nothing, on a CPU engine: the forward thread's capture
  work per decode step, and the time to every result when they all end together.
- One request's rows (512 positions) handed to an ``isolation=thread`` consumer: fresh memory against the
  reused block.

- Copies off the forward thread, alone and beside a thread that keeps the interpreter lock as a busy forward
  loop does (pure Python for 2 ms, then a 0.1 ms sleep): a step's ``[layers, requests, hidden]`` bf16 block
  split per request (a clone each, against ``host_copies.split_copies``), and one request's every-token rows
  gathered from 512 chunks (numpy, against one ``torch.cat``).

Microseconds or milliseconds per call, medians of five timings of ``--repeats`` calls each.
"""

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from functools import partial
from types import SimpleNamespace

import msgspec
import numpy as np
import torch

from vllm_interp.capture.consumer import (
    CaptureConsumer,
    CaptureMeta,
    ConsumerContext,
    EngineFacts,
    PendingCapture,
    RequestCapture,
)
from vllm_interp.capture.consumers.inline import InlineConsumer, ResidualReadout
from vllm_interp.capture.consumers.logging import LoggingConsumer
from vllm_interp.capture.dispatch import ConsumerRunner, ForwardGate
from vllm_interp.capture.host_copies import as_array, split_copies
from vllm_interp.capture.isolation import InThread
from vllm_interp.capture.plugins import DEFAULT_QUEUE_MB
from vllm_interp.capture.results import ConsumerResult, result_to_json
from vllm_interp.capture.spec import spec_to_wire, validate_capture_spec
from vllm_interp.capture.store import CaptureStore
from vllm_interp.config import InterpConfig
from vllm_interp.engine.v0_26.steps import InterpSteps
from vllm_interp.frontend import InterpFrontend, PreparedRequest
from vllm_interp.hooks import HOOKS, ModelShape, site_name
from vllm_interp.models import site_ops
from vllm_interp.models.registry import SiteBank
from vllm_interp.models.site_kernel import site_in_graph, steer_in_place, steering_alone_args
from vllm_interp.patching.sources import SourceStore
from vllm_interp.patching.tables import PatchTables
from vllm_interp.request_args import EXTRA_ARGS_KEY
from vllm_interp.row_plan import BatchLayout
from vllm_interp.server.bodies import parse_json
from vllm_interp.server.request_fields import RequestFieldsMiddleware, _ResultStream
from vllm_interp.steering.tables import SteeringTables, table_rows
from vllm_interp.steering.vectors import SteeringVectors, pack_vectors
from vllm_interp.uploads import to_device


def per_call_s(call: Callable[[], object], repeats: int) -> float:
    call()
    timings = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeats):
            call()
        timings.append((time.perf_counter() - start) / repeats)
    return statistics.median(timings)


def site_bank(layers: int, hidden: int, *, steer_rows: int, dtype: torch.dtype,
              device: str = "cpu") -> SiteBank:
    """An engine's site buffers for ``layers`` layers (no patching, no graph reads)."""
    return SiteBank.allocate(list(range(layers)), hidden_size=hidden, dtype=dtype, device=torch.device(device),
                             max_tokens=8, steer_rows=steer_rows, patch_slots=1, graph_read_rows=0)


class DiscardingSink(CaptureConsumer):
    """A bulk sink's way of taking rows (parts of 8 MiB, as ``filesystem``'s sharded layout) that keeps
    nothing: the store's work for such a consumer, without the writing."""

    name = "sink"

    @classmethod
    def part_bytes(cls, options: dict) -> int:
        return 8 << 20

    def consume(self, capture: RequestCapture) -> dict:
        return {"rows": sum(t.shape[0] for t in capture.tensors.values())}

    @classmethod
    def merge_parts(cls, results: list[dict]) -> dict:
        return {"parts": len(results)}


def capture_store(layers: int, hidden: int, consumer_class: type[CaptureConsumer] = LoggingConsumer) -> CaptureStore:
    bank = site_bank(layers, hidden, steer_rows=1, dtype=torch.float32)
    name = consumer_class.name
    context = ConsumerContext(name, consumer_class.validate_engine_options({}), "m", num_layers=layers,
                              hidden_size=hidden)
    # The engine's default queue: a smaller one makes finalizing wait for the consumer to make room.
    runner = ConsumerRunner(InThread(consumer_class(context)), policy="block", queue_bytes=DEFAULT_QUEUE_MB << 20)
    return CaptureStore(bank, num_layers=layers, model="m", consumers={name: runner}, global_spec={},
                        external_id=str, max_graph_tokens=0)


def planning_us(positions: str, args: argparse.Namespace) -> float:
    store = capture_store(args.layers, args.hidden)
    spec = validate_capture_spec({"logging": {"hooks": {"post_block": "all"}, "positions": positions}},
                                 engine=EngineFacts(args.layers), consumers={"logging": LoggingConsumer})
    ids = [f"req-{i}" for i in range(args.requests)]
    for req_id in ids:
        store.lookup(req_id, {EXTRA_ARGS_KEY: {"capture": spec_to_wire(spec)}}, prompt_len=128)
    layout = BatchLayout.of(ids, np.arange(args.requests + 1), np.full(args.requests, 200))  # one decode token each
    try:
        tokens = layout.total_tokens
        return per_call_s(lambda: store.site_reads(store.plan_reads(layout), torch.device("cpu"), tokens),
                          args.repeats) * 1e6
    finally:
        store.close()


def capture_wave_us(args: argparse.Namespace) -> dict[str, float]:
    """The worker's share of a wave of ``--requests`` requests capturing ``last_prompt`` at every site to
    ``inline`` (the serving bench's capture workload), per request: on the forward thread, each admitted (its
    spec decoded), one prefill step of them planned, its reads collected and landed, and each finished (handed to
    the consumer, without waiting for it); then until every result is in (the consumer's runner thread gathering
    and packing each). The eager forward's reads are stand-ins: a row per request and site."""
    layers, hidden, count = args.layers, args.hidden, args.requests
    bank = site_bank(layers, hidden, steer_rows=1, dtype=torch.bfloat16)
    context = ConsumerContext("inline", {}, "m", num_layers=layers, hidden_size=hidden)
    runner = ConsumerRunner(InThread(InlineConsumer(context)), policy="block", queue_bytes=1 << 30)
    store = CaptureStore(bank, num_layers=layers, model="m", consumers={"inline": runner}, global_spec={},
                         external_id=str, max_graph_tokens=0)
    spec = {"inline": {"hooks": "all", "positions": "last_prompt"}}
    prompt_len, chunk = 512, 8
    rows = torch.zeros(count, hidden, dtype=torch.bfloat16)
    wave = [0]
    forward_s: list[float] = []

    def one_wave() -> None:
        ids = [f"w{wave[0]}-{i}" for i in range(count)]
        wave[0] += 1
        started = time.perf_counter()
        for req_id in ids:
            store.lookup(req_id, {EXTRA_ARGS_KEY: {"capture": spec, "capture_key": req_id}}, prompt_len)
        # The prompts' last chunks: each request's last prompt position is read.
        layout = BatchLayout.of(ids, np.arange(0, (count + 1) * chunk, chunk), np.full(count, prompt_len - chunk))
        plan = store.plan_reads(layout)
        reads = store.site_reads(plan, torch.device("cpu"), layout.total_tokens)
        reads.out.update({site: rows for site in reads.sites})
        store.collect(plan, reads)
        store.finish(set(ids))
        forward_s.append(time.perf_counter() - started)
        lengths = dict.fromkeys(ids, prompt_len + 1)
        while lengths:
            for key in store.results(lengths, wait_s=1.0):
                del lengths[key]

    try:
        whole = per_call_s(one_wave, max(args.repeats // 200, 3))
        return {"the forward thread": statistics.median(forward_s) * 1e6 / count,
                "until every result is in": whole * 1e6 / count}
    finally:
        store.close()


class _PlanningRunner(InterpSteps):
    """The runner mixins' shared step logic, with requests kept as the V2 mixin keeps them."""

    device = torch.device("cpu")

    def __init__(self, requests: dict[str, tuple[dict | None, int]]) -> None:
        self.requests = requests

    def interp_request(self, req_id: str) -> tuple[dict | None, int]:
        return self.requests[req_id]


def step_plan_us(args: argparse.Namespace) -> dict[str, float]:
    """The runner's plan of one decode step of ``--requests`` requests (steering, patching and capture enabled):
    none of them using a feature, then each with its own all-layer steering config."""
    configs = args.requests
    bank = SiteBank.allocate(list(range(args.layers)), hidden_size=args.hidden, dtype=torch.bfloat16,
                             device=torch.device("cpu"), max_tokens=args.requests, steer_rows=table_rows(configs),
                             patch_slots=1, graph_read_rows=0)
    ids = [f"req-{i}" for i in range(args.requests)]
    rng = np.random.default_rng(0)
    steered = {}
    for req_id in ids:
        vectors = SteeringVectors({"base": {site_name(layer, "post_block"): rng.standard_normal(args.hidden)
                                            .astype(np.float32) for layer in range(args.layers)}})
        steered[req_id] = ({EXTRA_ARGS_KEY: {"steering": {"vectors": vectors.to_wire(),
                                                          "digest": vectors.digest()}}}, 512)
    query_start_loc, num_computed = np.arange(args.requests + 1), np.full(args.requests, 600)
    timings = {}
    for what, requests in (("no request using a feature", dict.fromkeys(ids, (None, 512))),
                           ("every request its own steering config", steered)):
        store = capture_store(args.layers, args.hidden)
        runner = _PlanningRunner(requests)
        runner.attach(store, SteeringTables(bank, configs), PatchTables(bank, SourceStore()))
        try:
            timings[what] = per_call_s(partial(runner._interp_plan, ids, query_start_loc, num_computed),
                                       args.repeats) * 1e6
        finally:
            store.close()
    return timings


def api_server_ms(args: argparse.Namespace) -> dict[str, float]:
    """Per request, on the API server's one event loop: an all-layer steered request (the compact base64 form
    of ``post_block`` at every layer) and a request capturing ``last_prompt`` at every site to ``inline``, both
    with a 512-token prompt, as benchmarks/serve.py sends them; the request body's rewrite by the middleware
    (parse, validation, payload), and the capture results' way back as JSON."""
    frontend = InterpFrontend.for_engine(InterpConfig(enable_steering=True, capture_consumers=("inline",)),
                                         ModelShape(args.layers, args.hidden))
    state = SimpleNamespace(vllm_interp_frontend=frontend, vllm_interp_max_model_len=1040)
    scope = {"app": SimpleNamespace(state=state), "path": "/v1/completions",
             "headers": [(b"content-type", b"application/json")]}
    middleware = RequestFieldsMiddleware(None)
    table = np.random.default_rng(0).standard_normal((args.layers, args.hidden)).astype(np.float32)
    plain = {"model": "m", "prompt": list(range(100, 612)), "max_tokens": 512, "stream": True}
    steered = json.dumps({**plain, "steering_vectors": {"post_block": pack_vectors(dict(enumerate(table)))}}).encode()
    capturing = json.dumps({**plain, "capture": {"inline": {"hooks": "all", "positions": "last_prompt"}}}).encode()
    fields = {"steering_vectors": parse_json(steered, "application/json")["steering_vectors"]}
    wire = frontend.prepare(fields, None, None, collect=True).payload["steering"]["vectors"]
    sites = [site_name(layer, hook) for layer in range(args.layers) for hook in HOOKS]
    rows = {site: torch.randn(1, args.hidden).to(torch.bfloat16) for site in sites}
    result = ConsumerResult(status="ok", rows=len(sites),
                            result=ResidualReadout([511], rows, {"positions": [511]}).to_result())
    loop = asyncio.new_event_loop()
    repeats = max(args.repeats // 10, 20)
    try:
        return {
            "steered body KB": len(steered) / 1024,
            "steered: JSON parse": per_call_s(lambda: parse_json(steered, "application/json"), repeats) * 1e3,
            "steered: validation and payload (prepare)": per_call_s(
                lambda: frontend.prepare(fields, None, None, collect=True), repeats) * 1e3,
            "steered: the middleware's whole rewrite": per_call_s(
                lambda: loop.run_until_complete(middleware._rewrite(scope, steered)), repeats) * 1e3,
            "steered: the worker's decoding (from_wire)": per_call_s(
                lambda: SteeringVectors.from_wire(wire), repeats) * 1e3,
            "capturing: the middleware's whole rewrite": per_call_s(
                lambda: loop.run_until_complete(middleware._rewrite(scope, capturing)), repeats) * 1e3,
            f"capturing: {len(sites)} sites' inline result to JSON": per_call_s(
                lambda: msgspec.json.encode(result_to_json(result, InlineConsumer.result_to_json)), repeats) * 1e3,
        }
    finally:
        loop.close()


def new_config_ms(args: argparse.Namespace) -> float:
    """The worker admitting a request whose all-layer steering config is new (``SteeringTables.lookup``, and its
    slot's prefill and decode rows written), per config, over 128 distinct configs in a bf16 table admitted
    together (as a burst of requests is, a step's worth at a time)."""
    configs = 128
    bank = site_bank(args.layers, args.hidden, steer_rows=table_rows(configs), dtype=torch.bfloat16,
                     device=args.device)
    rng = np.random.default_rng(0)
    requests = []
    for _ in range(configs):
        vectors = SteeringVectors({"base": {site_name(layer, "post_block"): rng.standard_normal(args.hidden)
                                            .astype(np.float32) for layer in range(args.layers)}})
        requests.append({EXTRA_ARGS_KEY: {"steering": {"vectors": vectors.to_wire(), "digest": vectors.digest()}}})

    def admit_all() -> None:
        tables = SteeringTables(bank, configs)
        for i, extra_args in enumerate(requests):
            tables.lookup(f"req-{i}", extra_args)
        tables.upload_pending()  # all at once, as before the step that admits them

    return per_call_s(admit_all, max(args.repeats // 1000, 3)) / configs * 1e3


def in_thread_ms(args: argparse.Namespace) -> dict[str, float]:
    """A request of 512 positions x ``--layers`` sites x ``--hidden`` bf16 handed to an ``isolation=thread``
    consumer that does nothing: into fresh memory (as every request was before blocks were reused) and into
    the reused block."""
    sites = [site_name(layer, "post_block") for layer in range(args.layers)]
    meta = CaptureMeta(request_id="r", tag=None, model="m", prompt_len=256, positions=list(range(512)),
                       sites=sites, dtype="bfloat16")
    pending = PendingCapture.of(RequestCapture(meta, {s: torch.randn(512, args.hidden).to(torch.bfloat16)
                                                      for s in sites}))
    host = InThread(NullConsumer(ConsumerContext("null", {}, "m", num_layers=args.layers, hidden_size=args.hidden)))

    def fresh() -> None:
        host._spare = None
        host.submit(pending).result()

    repeats = max(args.repeats // 200, 5)
    return {f"{pending.nbytes / 1e6:.0f} MB into fresh memory": per_call_s(fresh, repeats) * 1e3,
            "into the reused block": per_call_s(lambda: host.submit(pending).result(), repeats) * 1e3}


def beside_consumers_ms(args: argparse.Namespace) -> dict[str, tuple[float, float]]:
    """A forward-like loop on this thread (1,500 small tensor ops, each giving up the interpreter lock as a
    forward's launches do) alone, beside an ``inline`` runner consuming 32 ``last_prompt`` requests at every
    site (the gate left open), and the same with the forward gate closed around the loop, as the runner mixins
    close it; both again with Python's switch interval at 0.5 ms instead of 5. Per variant, medians in ms: the
    loop, and the wait after it until the 32 are consumed."""
    sites = [site_name(layer, hook) for layer in range(args.layers) for hook in HOOKS]
    context = ConsumerContext("inline", {}, "m", num_layers=args.layers, hidden_size=args.hidden)
    gate = ForwardGate()
    runner = ConsumerRunner(InThread(InlineConsumer(context)), policy="block", queue_bytes=1 << 30, gate=gate)
    rows = torch.randn(len(sites), 1, args.hidden).to(torch.bfloat16)
    stream = torch.randn(64, 64)

    def pending() -> PendingCapture:
        meta = CaptureMeta(request_id="r", tag=None, model="m", prompt_len=512, positions=[511], sites=sites,
                           dtype="bfloat16")
        return PendingCapture(meta, args.hidden, torch.bfloat16, lambda block: block.copy_(rows))

    def loop_and_rest(requests: int, gated: bool) -> tuple[float, float]:
        futures = [runner.submit(pending(), ConsumerResult(status="ok")) for _ in range(requests)]
        start = time.perf_counter()
        with gate.launching() if gated else nullcontext():
            for _ in range(1500):
                stream.add_(0.0)
        looped = time.perf_counter()
        for future in futures:
            future.result()
        return (looped - start) * 1e3, (time.perf_counter() - looped) * 1e3

    def medians(requests: int, gated: bool) -> tuple[float, float]:
        runs = [loop_and_rest(requests, gated) for _ in range(max(args.repeats // 100, 5))]
        return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)

    default_interval = sys.getswitchinterval()
    try:
        timings = {"alone": medians(0, False), "beside the runner": medians(32, False),
                   "beside the runner, gate closed around the loop": medians(32, True)}
        sys.setswitchinterval(0.0005)  # as --engine-switch-interval-ms 0.5 sets it in the engine
        timings["beside the runner, switch interval 0.5 ms"] = medians(32, False)
        timings["beside the runner, gate closed, switch interval 0.5 ms"] = medians(32, True)
        return timings
    finally:
        sys.setswitchinterval(default_interval)
        runner.close()


class NullConsumer(CaptureConsumer):
    def consume(self, capture: RequestCapture) -> dict:
        return {}


def eager_site_us(args: argparse.Namespace) -> dict[str, float]:
    """The site op's eager body, per call over every site of a prefill step of 8,192 tokens (the stream a
    ``(hidden, residual)`` pair, as Llama's layers carry it) on ``--device``: sites the step leaves alone, and
    sites reading one row per request finishing its prompt in the step (16: 512-token prompts). On CUDA also
    sites steering every row (each token its config's vector), and the steering add alone in its two forms: the
    site kernel's one launch (CUDA's eager path) and ``index_select`` + ``add_`` (the CPU's; on the CPU a steered
    site's add is compute, tens of ms a call at these sizes); and the site kernel's launch on a 64-token stream,
    where the host's share shows, through Triton's argument binding and launched again directly. A wave's prefill
    steps run eagerly, host-bound on a GPU host; py-spy put 50-130 us a call of the body on an H200 host's forward
    thread (serve-gpu-2026-11-29.md, session 22)."""
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    bank = site_bank(args.layers, args.hidden, steer_rows=table_rows(8), dtype=dtype, device=args.device)
    bank.steer_table.normal_()
    bank.steer_table[:, :, 0] = 0  # row 0: unsteered
    tokens = 8192
    hidden = torch.randn(tokens, args.hidden, dtype=dtype, device=device)
    residual = torch.randn(tokens, args.hidden, dtype=dtype, device=device)
    # The bank's index holds 8 tokens; a prefill step's holds one row per token.
    steer_index = torch.randint(1, bank.steer_table.shape[2], (tokens,), device=device)
    sites = [(layer, hook) for layer in range(args.layers) for hook in range(len(HOOKS))]

    def per_site_us(call: Callable[[int, int], object]) -> float:
        def step() -> None:
            for layer, hook in sites:
                call(layer, hook)
            if cuda:
                torch.cuda.synchronize()
        return per_call_s(step, max(1, args.repeats // 20)) / len(sites) * 1e6

    def site(layer: int, hook: int) -> None:
        site_ops.site(hidden, residual, steer_index, bank.steer_table[layer], bank.patch_index[layer],
                      bank.patch_values, bank.patch_alpha, bank.read_slot, bank.read_flags[layer],
                      bank.read_out[layer], layer, hook, False)

    rows = to_device(np.arange(511, tokens, 512), device)
    cases = [("idle", None, frozenset()), ("reading 16 rows", site_ops.StepReads(rows, frozenset(sites)), frozenset())]
    timings = {}
    for what, reads, steer in cases + ([("steering every row", None, frozenset(sites))] if cuda else []):
        site_ops.STEP.reads, site_ops.STEP.steer = reads, steer
        timings[what] = per_site_us(site)
    site_ops.STEP.reads, site_ops.STEP.steer = None, frozenset()
    if cuda:
        table = bank.steer_table
        timings["the steering add alone: the site kernel's launch"] = per_site_us(
            lambda layer, hook: steer_in_place(residual, steer_index, table[layer, hook]))
        timings["the steering add alone: index_select + add_"] = per_site_us(
            lambda layer, hook: residual.add_(table[layer, hook].index_select(0, steer_index)))
        # A 64-token stream: the device's share is small enough that these time the launch on the host.
        short, short_index = residual[:64].clone(), steer_index[:64].clone()
        timings["the steering add alone on 64 rows (host-bound): through Triton's launch"] = per_site_us(
            lambda layer, hook: site_in_graph(*steering_alone_args(short, short_index, table[layer, hook])))
        timings["the steering add alone on 64 rows (host-bound): launched again directly"] = per_site_us(
            lambda layer, hook: steer_in_place(short, short_index, table[layer, hook]))
    return timings


def stream_event_us(args: argparse.Namespace) -> float:
    """One token's event of a capturing stream through the middleware (a compact event, as vLLM writes them)."""
    event = b"data: " + json.dumps({
        "id": "cmpl-1a2b3c4d5e6f", "object": "text_completion", "created": 1764290000, "model": "m",
        "choices": [{"index": 0, "text": " hello", "logprobs": None, "finish_reason": None, "stop_reason": None}],
        "usage": None}, separators=(",", ":")).encode() + b"\n\n"

    async def sent(message: dict) -> None:
        pass

    stream = _ResultStream(sent, None, PreparedRequest({}, "key", ("inline",)), strip_usage=False)
    message = {"type": "http.response.body", "body": event, "more_body": True}
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(stream.send({"type": "http.response.start", "status": 200}))

        async def events() -> None:
            for _ in range(1000):
                await stream.send(message)

        return per_call_s(lambda: loop.run_until_complete(events()), max(args.repeats // 100, 5)) * 1e3
    finally:
        loop.close()


def copies_ms(args: argparse.Namespace) -> dict[str, tuple[float, float]]:
    """Each copy's time alone and beside a busy thread (see the module docstring)."""
    block = torch.randn(args.layers, args.requests, args.hidden).to(torch.bfloat16)
    splits = [(i, i + 1) for i in range(args.requests)]
    chunks = [torch.randn(args.layers, 1, args.hidden).to(torch.bfloat16) for _ in range(512)]
    arrays = [as_array(chunk) for chunk in chunks]
    out = torch.empty(args.layers, 512, args.hidden, dtype=torch.bfloat16)
    calls = {
        "split, a clone per request": lambda: [block[:, a:b].clone() for a, b in splits],
        "split, split_copies": lambda: split_copies(block, splits),
        "gather, np.concatenate": lambda: np.concatenate(arrays, axis=1, out=as_array(out)),
        "gather, torch.cat": lambda: torch.cat(chunks, dim=1, out=out),
    }
    repeats = max(args.repeats // 200, 5)
    alone = {name: per_call_s(call, repeats) * 1e3 for name, call in calls.items()}
    stop = threading.Event()

    def busy() -> None:
        while not stop.is_set():
            until = time.perf_counter() + 0.002
            while time.perf_counter() < until:
                pass
            time.sleep(0.0001)

    thread = threading.Thread(target=busy, daemon=True)
    thread.start()
    try:
        beside = {name: per_call_s(call, repeats) * 1e3 for name, call in calls.items()}
    finally:
        stop.set()
        thread.join()
    return {name: (alone[name], beside[name]) for name in calls}


def every_token_ms(args: argparse.Namespace, consumer_class: type[CaptureConsumer] = LoggingConsumer,
                   steps: int = 256) -> dict[str, float]:
    """``--requests`` requests capturing every position at ``post_block`` of every layer to ``logging`` (packed;
    or, ``DiscardingSink``, in parts as a bulk sink takes them) on a CPU engine: the forward thread's capture work
    per decode step (plan, the stand-in reads, collect: the statistics and the landing, filing the landed step,
    cutting parts), over ``steps`` steps; then, all ending together, the forward thread's time to finalize them
    (the first ask for their results) and the time until every result is in (gathering and packing on the
    consumer's thread too)."""
    layers, hidden, count, prompt_len = args.layers, args.hidden, args.requests, 16
    store = capture_store(layers, hidden, consumer_class)
    name = consumer_class.name
    packed = {"format": "packed"} if consumer_class is LoggingConsumer else {}
    spec = validate_capture_spec({name: {"hooks": {"post_block": "all"}, "positions": "all", **packed}},
                                 engine=EngineFacts(layers), consumers={name: consumer_class})
    ids = [f"req-{i}" for i in range(count)]
    for i, req_id in enumerate(ids):
        store.lookup(req_id, {EXTRA_ARGS_KEY: {"capture": spec_to_wire(spec), "capture_key": f"key-{i}"}},
                     prompt_len)
    rows = torch.randn(count, hidden)
    try:
        started = time.perf_counter()
        for step_index in range(steps):
            layout = BatchLayout.of(ids, np.arange(count + 1), np.full(count, prompt_len + step_index))
            plan = store.plan_reads(layout)
            reads = store.site_reads(plan, torch.device("cpu"), layout.total_tokens)
            reads.out.update({site: rows for site in reads.sites})
            store.collect(plan, reads)
        per_step = (time.perf_counter() - started) / steps
        lengths = {f"key-{i}": prompt_len + steps + 1 for i in range(count)}
        started = time.perf_counter()
        answered = store.results(lengths, wait_s=0.0)  # ends and finalizes them all (the CPU's copies have landed)
        finalizing = time.perf_counter() - started
        while len(answered) < count:
            answered.update(store.results({k: n for k, n in lengths.items() if k not in answered}, wait_s=1.0))
        return {"forward thread per decode step": per_step * 1e3,
                f"forward thread finalizing all {count}": finalizing * 1e3,
                f"every result after all {count} end": (time.perf_counter() - started) * 1e3}
    finally:
        store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=2000)
    parser.add_argument("--device", default="cpu",
                        help="where the steering table of the new-config cost and the eager site op's stream live")
    parser.add_argument("--only", default=None,
                        help=f"comma-separated sections to run (default: all): {', '.join(SECTIONS)}")
    args = parser.parse_args()
    chosen = SECTIONS if args.only is None else args.only.split(",")
    unknown = set(chosen) - set(SECTIONS)
    if unknown:
        parser.error(f"--only: unknown {sorted(unknown)} (known: {', '.join(SECTIONS)})")
    for name in chosen:
        SECTIONS[name](args)


def print_planning(args: argparse.Namespace) -> None:
    print(f"Capture planning, one decode step of {args.requests} requests reading post_block of {args.layers} layers:")
    for positions in ("all", "all_generated"):
        print(f"  positions={positions}: {planning_us(positions, args):.0f} us a step")


def print_wave(args: argparse.Namespace) -> None:
    print(f"A wave of {args.requests} requests capturing last_prompt at all {3 * args.layers} sites to inline, "
          "us a request:")
    for what, value in capture_wave_us(args).items():
        print(f"  {what}: {value:.0f}")


def print_step_plan(args: argparse.Namespace) -> None:
    print(f"The runner's plan of a decode step of {args.requests} requests, every feature enabled:")
    for what, value in step_plan_us(args).items():
        print(f"  {what}: {value:.0f} us")


def print_api_server(args: argparse.Namespace) -> None:
    print(f"One request on the API server, {args.layers} layers x {args.hidden}:")
    for what, value in api_server_ms(args).items():
        print(f"  {what}: {value:.3f}" + ("" if what.endswith("KB") else " ms"))
    print(f"The worker admitting a new all-layer steering config (its table rows): {new_config_ms(args):.3f} ms")
    print(f"A capturing stream's token event through the middleware: {stream_event_us(args):.2f} us")


def print_eager_site(args: argparse.Namespace) -> None:
    print(f"The site op's eager body at {3 * args.layers} sites of an 8,192-token prefill step, on {args.device}, "
          "us a call:")
    for what, value in eager_site_us(args).items():
        print(f"  {what}: {value:.1f}")


def print_beside_consumers(args: argparse.Namespace) -> None:
    print("A forward-like loop of 1,500 small ops beside 32 inline requests' consumption (the loop / the wait "
          "after it for the requests):")
    for what, (loop_ms, rest_ms) in beside_consumers_ms(args).items():
        print(f"  {what}: {loop_ms:.2f} / {rest_ms:.2f} ms")


def print_every_token(args: argparse.Namespace) -> None:
    for consumer_class, how in ((LoggingConsumer, "logging (packed)"), (DiscardingSink, "a sink in 8 MiB parts")):
        print(f"Every-token capture of {args.requests} requests at post_block of {args.layers} layers to {how}, "
              f"256 decode steps:")
        for what, value in every_token_ms(args, consumer_class).items():
            print(f"  {what}: {value:.2f} ms")


def print_copies(args: argparse.Namespace) -> None:
    print("One request's rows to an isolation=thread consumer that does nothing:")
    for what, value in in_thread_ms(args).items():
        print(f"  {what}: {value:.1f} ms")
    print(f"Copies off the forward thread, {args.requests} requests x {args.layers} layers x {args.hidden} bf16 "
          "(alone / beside a busy thread):")
    for what, (alone, beside) in copies_ms(args).items():
        print(f"  {what}: {alone:.2f} / {beside:.2f} ms")


# In the order they run by default.
SECTIONS: dict[str, Callable[[argparse.Namespace], None]] = {
    "planning": print_planning, "wave": print_wave, "step_plan": print_step_plan, "api_server": print_api_server,
    "eager_site": print_eager_site, "beside_consumers": print_beside_consumers, "every_token": print_every_token,
    "copies": print_copies,
}

if __name__ == "__main__":
    main()
