"""The one path from a request's vllm-interp fields to its engine payload, and from the workers' answers
back to its results, shared by every front door (offline ``LLM``, the HTTP middleware, patch sweeps).

``InterpFrontend.prepare`` turns validated steering fields, a capture spec and a patch spec into the
``extra_args["vllm_interp"]`` payload: the request's own vectors, its capture spec, its patch spec, the
prefix-cache salt (which positions' KV depend on the request's interventions) and, when the caller will
collect results, a key. ``collect_results`` is the polling loop around ``ResultCollector`` for the offline
engine; on an event loop (the HTTP middleware, contrastive vectors, patch sweeps) one ``ResultsPoller`` polls
for every request awaiting results at once.
"""

import asyncio
import contextlib
import hashlib
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any
from uuid import uuid4

from vllm_interp.capture.consumer import CaptureConsumer, EngineFacts
from vllm_interp.capture.plugins import consumer_class
from vllm_interp.capture.results import ConsumerResult, ResultCollector
from vllm_interp.capture.spec import CaptureSpec, spec_to_wire, validate_capture_spec
from vllm_interp.config import FrontendLimits, InterpConfig
from vllm_interp.hooks import ModelShape
from vllm_interp.patching.spec import PatchSpec, validate_patch
from vllm_interp.patching.tables import PATCH_RESULT
from vllm_interp.sae import load_saes
from vllm_interp.steering.state import SteeringState
from vllm_interp.steering.vectors import SteeringVectors

RESULTS_TIMEOUT_S = 600.0
# Position selections that end with the prompt whatever the request generates (a list may name generated ones).
PROMPT_ONLY_POSITIONS = ("last_prompt", "all_prompt")
SOURCES_RPC = "interp_patch_sources"
RESULTS_RPC = "interp_capture_results"


@dataclass(frozen=True)
class PreparedRequest:
    payload: dict[str, Any]  # extra_args["vllm_interp"]
    key: str | None  # set when results will be collected
    expects: tuple[str, ...]  # the results the caller collects: capture consumers, then "patch"
    # Its results are whole once its prompt has run (it captures prompt positions only, patches nothing, and the
    # engine captures nothing of every request): a stream may collect them from its first token on instead of
    # holding its last one while they are fetched.
    results_at_prefill: bool = False


def prefix_salt(effective: SteeringVectors, patch: PatchSpec | None) -> dict[str, Any] | None:
    """Where the request's KV starts to differ from an unintervened run, and a digest of why.

    Base and prefill vectors change every position's KV, decode vectors only generated ones
    (``from_prompt_end``), a patch everything from its lowest patched position on."""
    parts, start, from_prompt_end = [], None, False
    if not effective.is_empty:
        parts.append(f"steering:{effective.digest()}")
        if effective.affects_prefill:
            start = 0
        else:
            from_prompt_end = True
    if patch is not None:
        parts.append(f"patch:{patch.digest()}")
        start = patch.first_position if start is None else min(start, patch.first_position)
    if not parts:
        return None
    digest = hashlib.sha256("|".join(parts).encode()).hexdigest()[:32]
    return {"digest": digest, "from_position": start, "from_prompt_end": from_prompt_end}


def combined_generations(per_rank: list[Mapping[str, Mapping[str, Any]]]) -> dict[str, str]:
    """run id -> generation over all ranks (pipeline stages hold their own layers of a run; tensor-parallel
    ranks identical copies): the distinct per-rank generations joined in rank order."""
    runs: dict[str, list[str]] = {}
    for rank in per_rank:
        for run_id, info in rank.items():
            seen = runs.setdefault(run_id, [])
            if info["generation"] not in seen:
                seen.append(info["generation"])
    return {run_id: "|".join(gens) for run_id, gens in runs.items()}


def merged_sources(per_rank: list[Mapping[str, Mapping[str, Any]]]) -> dict[str, dict[str, Any]]:
    """run id -> the first rank's description of the run, with the generation over all ranks."""
    generations = combined_generations(per_rank)
    runs: dict[str, dict[str, Any]] = {}
    for rank in per_rank:
        for run_id, info in rank.items():
            runs.setdefault(run_id, {**info, "generation": generations[run_id]})
    return runs


class InterpFrontend:
    @classmethod
    def for_engine(cls, config: InterpConfig, shape: ModelShape,
                   limits: FrontendLimits | None = None) -> "InterpFrontend":
        """The frontend of an engine started with ``config`` on a model of ``shape``, admitting requests
        within ``limits`` (default: the defaults of every ``--max-*`` flag)."""
        limits = limits or FrontendLimits()
        saes = load_saes(config.saes, num_layers=shape.num_layers, hidden_size=shape.hidden_size)
        return cls(SteeringState(shape, enabled=config.enable_steering, saes=saes, limits=limits),
                   {name: consumer_class(name) for name in config.consumer_names},
                   patching=config.enable_patching, max_patch_rows=config.max_patch_rows, limits=limits,
                   global_capture=bool(config.capture_global))

    def __init__(self, steering: SteeringState, consumers: Mapping[str, type[CaptureConsumer]], *,
                 patching: bool, max_patch_rows: int, limits: FrontendLimits | None = None,
                 global_capture: bool = False) -> None:
        self.steering = steering
        self.global_capture = global_capture  # --capture-global: the workers capture every request too
        self.limits = limits or FrontendLimits()
        self.consumers = dict(consumers)
        self.patching = patching
        self.max_patch_rows = max_patch_rows
        # Merging a request's results needs each name's class; a patch status has no payload to merge.
        self.result_classes = {**self.consumers, PATCH_RESULT: CaptureConsumer}
        self.engine = EngineFacts(steering.shape.num_layers, steering.saes)
        # Brings the server-wide steering state up to date before a request is prepared: a no-op in one process;
        # several API servers share it through server/shared_steering.py.
        self.sync_steering: Callable[[], None] = lambda: None

    def validate_capture(self, raw: Any, field: str = "capture") -> CaptureSpec:
        """A request's capture spec, checked against this engine (errors name ``field``)."""
        return validate_capture_spec(raw, engine=self.engine, consumers=self.consumers, field=field)

    def validate_patch(self, raw: Any, run_generation: Callable[[str], str | None]) -> PatchSpec | None:
        return validate_patch(raw, shape=self.steering.shape, enabled=self.patching,
                              max_patches=self.max_patch_rows, run_generation=run_generation)

    def prepare(self, steering_fields: Mapping[str, Any], capture: CaptureSpec | None, patch: PatchSpec | None,
                *, collect: bool) -> PreparedRequest:
        self.sync_steering()
        own = self.steering.request_vectors(steering_fields)
        payload: dict[str, Any] = {}
        if not own.is_empty:
            payload["steering"] = {"vectors": own.to_wire(), "digest": own.digest()}
        salt = prefix_salt(self.steering.global_vectors + own, patch)
        if salt is not None:
            payload["prefix_salt"] = salt
        expects: tuple[str, ...] = ()
        if capture:
            payload["capture"] = spec_to_wire(capture)
            expects += tuple(capture)
        if patch is not None:
            payload["patch"] = patch.to_wire()
            expects += (PATCH_RESULT,)
        key = None
        if collect and expects:
            key = payload["capture_key"] = uuid4().hex
        at_prefill = (key is not None and patch is None and not self.global_capture
                      and all(spec.positions in PROMPT_ONLY_POSITIONS for spec in capture.values()))
        return PreparedRequest(payload, key, expects if key else (), results_at_prefill=at_prefill)

    def collector(self, lengths: dict[str, int | None], requests: Mapping[str, PreparedRequest]) -> ResultCollector:
        return ResultCollector(lengths, {key: list(prepared.expects) for key, prepared in requests.items()})

    def merged(self, collector: ResultCollector) -> dict[str, dict[str, ConsumerResult]]:
        return collector.merged(self.result_classes)


def collect_results(collector: ResultCollector, rpc: Callable[[dict[str, int | None], float], list],
                    timeout_s: float = RESULTS_TIMEOUT_S) -> None:
    """Poll the workers (``rpc(pending, wait_s)``) until every key is answered or the time is up."""
    deadline = time.monotonic() + timeout_s
    while collector.pending and time.monotonic() < deadline:
        collector.add(rpc(collector.pending, 0.2))


@dataclass
class _Waiter:
    collector: ResultCollector
    deadline: float
    done: asyncio.Future
    since: float  # when its caller began to wait
    patient: bool = False  # asked for early, nobody waiting yet: polled at the long interval (``hurry`` ends it)


class ResultsPoller:
    """Polls the workers for every capture key awaited on this event loop, all keys in one call per round.

    Requests that finish together (128 streams of one length end within a few steps) then share calls: each
    call is a utility call that the engine core runs between steps, and polled one by one they interrupted it
    once or twice per finishing request. A round that starts from idle waits ``gather_s`` first, so that the
    streams that finished in the same engine step (each reaches its end of stream a few event-loop turns after
    the one before) join it rather than the next round. Between rounds: ``first_interval_s`` while some
    caller has waited less than ``first_window_s`` (the first round hands a request that just ended to its
    consumers; 64 every-token requests ending together took the worker 10-25 ms to answer, and with three
    short rounds before the long interval an H200 host's streams waited 36-57 ms), ``interval_s`` after
    that, so that keys whose consumers take long are not asked for at the short interval. Keys asked for
    early (``patient``: a stream's prompt-only results, while it generates) ride along with other keys' rounds,
    and while only they wait, rounds come every ``patient_interval_s``: a wave of 128 starting streams, each
    asking at its first event, otherwise put a results call into the engine core between most of the wave's
    prefill steps (an H200 host's profile: 27 such calls between its eight prefill steps, four API servers
    polling every 20 ms). Their consumers are fed as rows land, not when asked, so asking late loses nothing;
    ``hurry`` makes one a fresh wait, at once, when its caller comes to need it, and a caller that waits cuts
    a patient interval short too."""

    @classmethod
    def for_engine(cls, engine_client: Any) -> "ResultsPoller":
        """Polling an async engine client's workers (``collective_rpc``)."""
        return cls(lambda pending, wait_s: engine_client.collective_rpc(RESULTS_RPC, args=(pending, wait_s)))

    def __init__(self, rpc: Callable[[dict[str, int | None], float], Awaitable[list]], interval_s: float = 0.02,
                 first_interval_s: float = 0.005, first_window_s: float = 0.06, gather_s: float = 0.002,
                 patient_interval_s: float = 0.25) -> None:
        self._rpc = rpc  # (capture key -> final length, seconds the workers may wait) -> per-rank answers
        self._interval_s, self._first_interval_s, self._gather_s = interval_s, first_interval_s, gather_s
        self._patient_interval_s = patient_interval_s
        self._first_window_s = first_window_s
        self._waiting: list[_Waiter] = []
        self._task: asyncio.Task | None = None
        self._hurried: asyncio.Event | None = None  # cuts the wait between rounds short (``hurry``)

    async def collect(self, collector: ResultCollector, timeout_s: float = RESULTS_TIMEOUT_S,
                      patient: bool = False) -> None:
        """Return once every key of ``collector`` is answered, or ``timeout_s`` has passed; ``patient``: asked
        for early (see the class)."""
        if not collector.pending:
            return
        done = asyncio.get_running_loop().create_future()
        now = time.monotonic()
        self._waiting.append(_Waiter(collector, now + timeout_s, done, since=now, patient=patient))
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._poll())
        elif not patient and self._hurried is not None and all(w.patient for w in self._waiting[:-1]):
            self._hurried.set()  # the poller waits the patient interval: this caller's wait cuts it short
        await done

    def hurry(self, collector: ResultCollector) -> None:
        """Its caller now waits for ``collector``'s keys, asked for patiently: poll them now, then as a fresh
        wait is polled."""
        for waiter in self._waiting:
            if waiter.collector is collector and waiter.patient:
                waiter.patient, waiter.since = False, time.monotonic()
                if self._hurried is not None:
                    self._hurried.set()

    async def _poll(self) -> None:
        await asyncio.sleep(self._gather_s)
        while self._waiting:
            round_ = list(self._waiting)
            pending = {key: n for waiter in round_ for key, n in waiter.collector.pending.items()}
            try:
                per_rank = await self._rpc(pending, 0.0)
            except Exception as exc:  # every caller of this round gets the error, as its own call would have
                for waiter in round_:
                    self._settle(waiter, exc)
                continue
            now = time.monotonic()
            for waiter in round_:
                collector = waiter.collector
                collector.add([{k: v for k, v in answers.items() if k in collector.lengths} for answers in per_rank])
                if not collector.pending or now >= waiter.deadline or waiter.done.done():  # done: caller went away
                    self._settle(waiter, None)
            if self._waiting:
                waiting = [waiter for waiter in self._waiting if not waiter.patient]
                self._hurried = asyncio.Event()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._hurried.wait(), self._interval_for(waiting, now))
                if not waiting and self._hurried.is_set():
                    await asyncio.sleep(self._gather_s)  # woken by a caller: others ending with it join the round
                self._hurried = None

    def _interval_for(self, waiting: list[_Waiter], now: float) -> float:
        """The wait before the next round, given the callers that wait (not the patient ones)."""
        if not waiting:
            return self._patient_interval_s
        early = any(now - waiter.since < self._first_window_s for waiter in waiting)
        return self._first_interval_s if early else self._interval_s

    def _settle(self, waiter: _Waiter, error: Exception | None) -> None:
        self._waiting.remove(waiter)
        if waiter.done.done():  # its caller went away
            return
        if error is not None:
            waiter.done.set_exception(error)
        else:
            waiter.done.set_result(None)
