"""Causal-tracing sweeps: every (hook, layer, position) cell of a grid patched from a clean run, graded
exactly, all cells through continuous batching at once.

``SweepRequest`` is the wire body of ``POST /v1/patch_sweep``; ``plan_sweep`` checks it against the model
and turns it into a ``SweepPlan`` (token alignment, the cells, the answer and foil ids); ``run_sweep`` runs
a plan on an engine client and yields events: ``start`` (the layout), one ``cell`` per cell as it finishes,
then ``summary`` (the whole response). A cell's grade is the exact log-probability of the answer and foil
ids at the first generated position (vLLM's ``logprob_token_ids``, from the full vocabulary); a cell whose
patch could not be applied reports its error, never a value.
"""

import asyncio
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal
from uuid import uuid4

import numpy as np
from pydantic import BaseModel, ConfigDict, StrictInt, ValidationError, field_validator, model_validator
from vllm import SamplingParams

from vllm_interp.capture.spec import CaptureSpec
from vllm_interp.frontend import InterpFrontend, PreparedRequest, ResultsPoller
from vllm_interp.hooks import Hook, canonical_hook
from vllm_interp.patching.spec import PatchEntry, PatchError, PatchSpec
from vllm_interp.patching.tables import PATCH_RESULT
from vllm_interp.request_args import EXTRA_ARGS_KEY

Metric = Literal["logprob", "logit_diff", "recovered"]


class LayerRange(BaseModel):
    model_config = ConfigDict(extra="forbid")
    start: StrictInt = 0
    stop: StrictInt | None = None
    step: StrictInt = 1


class Span(BaseModel):
    model_config = ConfigDict(extra="forbid")
    span: str
    occurrence: StrictInt = 0


class SweepRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | list[StrictInt]
    clean_prompt: str | list[StrictInt] | None = None
    source_run: str | None = None
    # Zero-ablation instead of patching from a clean run (no clean_prompt or source_run).
    ablate: bool = False
    hooks: list[Hook] | None = None
    hook: Hook | None = None
    layers: list[StrictInt] | LayerRange | Literal["all"] = "all"
    positions: list[StrictInt] | Literal["all_prompt"] | Span = "all_prompt"
    alpha: float = 1.0
    answer_token: str | None = None
    answer_token_id: StrictInt | None = None
    foil_token: str | None = None
    foil_token_id: StrictInt | None = None
    metric: Metric = "logprob"
    stream: bool = False

    @field_validator("hooks", "hook", mode="before")
    @classmethod
    def _canonical_hooks(cls, value: Any) -> Any:
        """TransformerLens spellings (``hook_resid_post``) name the same hooks; grids use ours."""
        if isinstance(value, list):
            if not value:
                raise ValueError("name at least one hook (or leave hooks out for post_block)")
            return [canonical_hook(h) or h for h in value]
        return canonical_hook(value) or value

    @model_validator(mode="after")
    def _one_of_each(self) -> "SweepRequest":
        sources = (self.clean_prompt is not None) + (self.source_run is not None) + self.ablate
        if sources != 1:
            raise ValueError("clean_prompt: give exactly one of clean_prompt, source_run and ablate")
        if self.hooks is not None and self.hook is not None:
            raise ValueError("hooks: give hooks or hook, not both")
        if (self.answer_token is None) == (self.answer_token_id is None):
            raise ValueError("answer_token: give exactly one of answer_token and answer_token_id")
        if self.foil_token is not None and self.foil_token_id is not None:
            raise ValueError("foil_token: give foil_token or foil_token_id, not both")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError("alpha: expected a number in [0, 1]")
        if self.metric == "logit_diff" and self.foil_token is None and self.foil_token_id is None:
            raise ValueError("metric: logit_diff needs a foil (foil_token or foil_token_id)")
        if self.metric == "recovered" and self.clean_prompt is None:
            raise ValueError("metric: recovered needs clean_prompt (the clean run's logprobs)")
        return self


def parse_sweep_request(raw: Any) -> SweepRequest:
    """The body as a ``SweepRequest``; a ``PatchError`` naming the field otherwise."""
    try:
        return SweepRequest.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(p) for p in first["loc"] if not (isinstance(p, str) and "[" in p))
        message = first["msg"].removeprefix("Value error, ")
        if not loc and ":" in message:  # a model-level check names its field first
            loc, message = message.split(":", 1)
            message = message.strip()
        raise PatchError(f"{loc or 'body'}: {message}") from None


@dataclass(frozen=True)
class Cell:
    index: int
    hook: str
    layer: int
    position: int  # in the corrupt prompt
    source_position: int  # in the clean run


@dataclass
class SweepPlan:
    request: SweepRequest
    tokens: list[int]  # corrupt
    clean_tokens: list[int] | None
    token_strings: list[str]
    clean_token_strings: list[str] | None
    hooks: list[str]
    layers: list[int]
    positions: list[int]
    answer_id: int
    foil_id: int | None
    alignment: dict[str, Any]
    skipped: list[dict[str, Any]]
    cells: list[Cell] = field(default_factory=list)

    def layout(self) -> dict[str, Any]:
        return {"layers": self.layers, "positions": self.positions, "hooks": self.hooks,
                "tokens": [self.token_strings[p] for p in self.positions], "prompt_tokens": self.token_strings,
                "clean_tokens": self.clean_token_strings, "answer_token_id": self.answer_id,
                "foil_token_id": self.foil_id, "alignment": self.alignment, "skipped": self.skipped,
                "metric": self.request.metric, "num_cells": len(self.cells)}


def _single_token(tokenizer, text: str | None, token_id: int | None, field_name: str, vocab: int) -> int | None:
    if token_id is not None:
        if not 0 <= token_id < vocab:
            raise PatchError(f"{field_name}_id: {token_id} is not a token id of this model (vocabulary {vocab})")
        return token_id
    if text is None:
        return None
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        raise PatchError(f"{field_name}: {text!r} is {len(ids)} tokens, not exactly one ({ids})")
    return ids[0]


def _align(clean: list[int], corrupt: list[int]) -> tuple[dict[int, int], dict[str, Any]]:
    """Corrupt position -> clean position: equal lengths map one to one; otherwise the common prefix by
    identity and the common suffix from the end, and the differing middle maps to nothing."""
    if len(clean) == len(corrupt):
        return {p: p for p in range(len(corrupt))}, {"kind": "identity", "length": len(corrupt)}
    prefix = 0
    while prefix < min(len(clean), len(corrupt)) and clean[prefix] == corrupt[prefix]:
        prefix += 1
    suffix = 0
    while (suffix < min(len(clean), len(corrupt)) - prefix
           and clean[len(clean) - 1 - suffix] == corrupt[len(corrupt) - 1 - suffix]):
        suffix += 1
    mapping = {p: p for p in range(prefix)}
    mapping.update({len(corrupt) - 1 - k: len(clean) - 1 - k for k in range(suffix)})
    return mapping, {"kind": "prefix_suffix", "common_prefix": prefix, "common_suffix": suffix,
                     "corrupt_middle": [prefix, len(corrupt) - suffix], "clean_middle": [prefix, len(clean) - suffix]}


def _positions(request: SweepRequest, tokenizer, tokens: list[int], prompt: str | None) -> list[int]:
    n = len(tokens)
    if request.positions == "all_prompt":
        return list(range(n))
    if isinstance(request.positions, Span):
        if prompt is None:
            raise PatchError("positions.span: a span needs a text prompt")
        start = -1
        for _ in range(request.positions.occurrence + 1):
            start = prompt.find(request.positions.span, start + 1)
            if start < 0:
                raise PatchError(f"positions.span: {request.positions.span!r} occurs fewer than "
                                 f"{request.positions.occurrence + 1} times in the prompt")
        end = start + len(request.positions.span)
        encoded = tokenizer(prompt, return_offsets_mapping=True)
        chosen = [i for i, (a, b) in enumerate(encoded["offset_mapping"]) if a < end and b > start and b > a]
        if not chosen:
            raise PatchError(f"positions.span: {request.positions.span!r} covers no token")
        return chosen
    bad = [p for p in request.positions if not 0 <= p < n]
    if bad:
        raise PatchError(f"positions: {bad} out of range for a {n}-token prompt")
    return sorted(set(request.positions))


def _layers(request: SweepRequest, num_layers: int) -> list[int]:
    if request.layers == "all":
        return list(range(num_layers))
    if isinstance(request.layers, LayerRange):
        r = request.layers
        if r.step < 1:
            raise PatchError("layers.step: must be >= 1")
        layers = list(range(r.start, num_layers if r.stop is None else r.stop, r.step))
    else:
        layers = sorted(set(request.layers))
    bad = [layer for layer in layers if not 0 <= layer < num_layers]
    if bad or not layers:
        raise PatchError(f"layers: {bad or 'none'} out of range for a model with {num_layers} layers")
    return layers


def plan_sweep(request: SweepRequest, *, tokenizer, num_layers: int, vocab: int, max_cells: int,
               max_model_len: int, source_positions: list[int] | None = None) -> SweepPlan:
    """Check a sweep against the model and lay out its cells (``source_positions``: the positions a
    ``source_run`` holds)."""
    def tokens_of(prompt):
        return list(prompt) if isinstance(prompt, list) else tokenizer.encode(prompt)

    tokens = tokens_of(request.prompt)
    if not tokens:
        raise PatchError("prompt: empty")
    clean = tokens_of(request.clean_prompt) if request.clean_prompt is not None else None
    if clean is not None and not clean:
        raise PatchError("clean_prompt: empty")
    for name, ids in (("prompt", tokens), ("clean_prompt", clean or [])):
        if any(not 0 <= t < vocab for t in ids):
            raise PatchError(f"{name}: token ids out of range for this model (vocabulary {vocab})")
        if len(ids) >= max_model_len:  # every run generates one token
            raise PatchError(f"{name}: {len(ids)} tokens; this model takes at most {max_model_len - 1} with the "
                             "token a sweep generates (--max-model-len)")
    answer = _single_token(tokenizer, request.answer_token, request.answer_token_id, "answer_token", vocab)
    foil = _single_token(tokenizer, request.foil_token, request.foil_token_id, "foil_token", vocab)
    if clean is not None:
        mapping, alignment = _align(clean, tokens)
    elif request.ablate:
        mapping, alignment = {p: p for p in range(len(tokens))}, {"kind": "ablation"}
    else:
        held = set(source_positions or [])
        mapping, alignment = {p: p for p in range(len(tokens)) if p in held}, {"kind": "source_run"}
    hooks = list(dict.fromkeys(request.hooks or [request.hook or "post_block"]))
    layers = _layers(request, num_layers)
    prompt_text = request.prompt if isinstance(request.prompt, str) else None
    wanted = _positions(request, tokenizer, tokens, prompt_text)
    positions = [p for p in wanted if p in mapping]
    skipped = [{"position": p, "token": tokenizer.convert_ids_to_tokens(tokens[p]),
                "reason": "no aligned clean position" if clean is not None else "not held by the source run"}
               for p in wanted if p not in mapping]
    count = len(hooks) * len(layers) * len(positions)
    if count > max_cells:
        raise PatchError(f"layers: {count} cells ({len(hooks)} hooks x {len(layers)} layers x {len(positions)} "
                         f"positions), more than this server's --max-sweep-cells ({max_cells})")
    if not count:
        raise PatchError("positions: no position to patch")
    plan = SweepPlan(request, tokens, clean, tokenizer.convert_ids_to_tokens(tokens),
                     tokenizer.convert_ids_to_tokens(clean) if clean is not None else None, hooks, layers,
                     positions, answer, foil, alignment, skipped)
    plan.cells = [Cell(i, hook, layer, p, mapping[p]) for i, (hook, layer, p) in
                  enumerate((h, layer, p) for h in hooks for layer in layers for p in positions)]
    return plan


# -- running -------------------------------------------------------------------------------------------
Generate = Callable[[list[int], SamplingParams, str], AsyncIterator[Any]]


def _grade(output, answer: int, foil: int | None) -> tuple[float, float | None]:
    logprobs = output.outputs[0].logprobs[0]
    return logprobs[answer].logprob, (logprobs[foil].logprob if foil is not None else None)


def _metric(metric: Metric, answer: float, foil: float | None, clean: dict, corrupt: dict) -> float | None:
    if metric == "logprob":
        return answer
    if metric == "logit_diff":
        return answer - foil
    gap = clean["answer_logprob"] - corrupt["answer_logprob"]
    return (answer - corrupt["answer_logprob"]) / gap if gap else math.nan


class SweepRunner:
    """Runs a plan: the clean capture (when given a clean prompt), the solo corrupt baseline, then every
    cell and an in-batch corrupt baseline together."""

    def __init__(self, plan: SweepPlan, frontend: InterpFrontend, generate: Generate, results: ResultsPoller,
                 run_generations: Callable[[], Awaitable[dict[str, str]]], delete_run: Callable[[str], Awaitable]):
        self.plan = plan
        self.frontend = frontend
        self.generate = generate
        self.results = results
        self.run_generations = run_generations
        self.delete_run = delete_run
        self.sweep_id = uuid4().hex[:12]
        self.timing: dict[str, float] = {}

    def _params(self, prepared: PreparedRequest | None) -> SamplingParams:
        ids = [self.plan.answer_id] + ([self.plan.foil_id] if self.plan.foil_id is not None else [])
        params = SamplingParams(temperature=0.0, max_tokens=1, logprob_token_ids=ids)
        if prepared is not None and prepared.payload:
            params.extra_args = {EXTRA_ARGS_KEY: prepared.payload}
        return params

    async def _one(self, tokens: list[int], prepared: PreparedRequest | None, name: str):
        final = None
        async for output in self.generate(tokens, self._params(prepared), f"sweep-{self.sweep_id}-{name}"):
            final = output
        return final

    async def _statuses(self, requests: dict[str, PreparedRequest], length: int) -> dict[str, dict]:
        """Each request's results (every one ran ``length`` tokens through the model, plus one sampled)."""
        collector = self.frontend.collector(dict.fromkeys(requests, length + 1), requests)
        await self.results.collect(collector)
        return self.frontend.merged(collector)

    async def events(self) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        plan, started = self.plan, time.monotonic()
        yield "start", plan.layout()
        run_id, own_run = plan.request.source_run, False
        clean = None
        if plan.clean_tokens is not None:
            run_id, own_run = f"sweep-{self.sweep_id}", True
            prepared = self.frontend.prepare({}, self._source_capture(run_id), None, collect=True)
            output = await self._one(plan.clean_tokens, prepared, "clean")
            status = (await self._statuses({prepared.key: prepared}, len(plan.clean_tokens)))[prepared.key]
            if status["patch_source"].status != "ok":
                raise PatchError(f"clean_prompt: the clean run could not be stored: {status['patch_source'].message}")
            answer, foil = _grade(output, plan.answer_id, plan.foil_id)
            clean = {"answer_logprob": answer, "foil_logprob": foil}
        self.timing["clean_s"] = time.monotonic() - started
        try:
            async for event in self._cells(run_id, clean):
                yield event
        finally:
            if own_run:
                await self.delete_run(run_id)

    def _source_capture(self, run_id: str) -> CaptureSpec:
        """The clean run keeps only what the cells patch from: the swept sites at every prompt position."""
        sites = {hook: self.plan.layers for hook in self.plan.hooks}
        return self.frontend.validate_capture(
            {"patch_source": {"hooks": sites, "positions": "all_prompt", "tag": run_id}})

    async def _cells(self, run_id: str, clean: dict | None) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        plan = self.plan
        start = time.monotonic()
        answer, foil = _grade(await self._one(plan.tokens, None, "corrupt"), plan.answer_id, plan.foil_id)
        corrupt = {"answer_logprob": answer, "foil_logprob": foil}
        spec_runs, zeros = {}, None
        if plan.request.ablate:
            zeros = np.zeros(self.frontend.steering.shape.hidden_size, dtype=np.float32)
        else:
            generations = await self.run_generations()
            if run_id not in generations:
                raise PatchError(f"source_run: unknown source run {run_id!r}")
            spec_runs = {run_id: generations[run_id]}
        prepared = {}
        for cell in plan.cells:
            source = dict(vector=zeros) if zeros is not None else dict(run=run_id, run_position=cell.source_position)
            entry = PatchEntry(cell.layer, cell.hook, cell.position, plan.request.alpha, **source)
            prepared[cell.index] = self.frontend.prepare({}, None, PatchSpec((entry,), spec_runs), collect=True)
        grids = {hook: {k: [[None] * len(plan.positions) for _ in plan.layers]
                        for k in ("answer_logprob", "foil_logprob", "metric")} for hook in plan.hooks}
        errors: list[dict[str, Any]] = []
        row_of = {layer: i for i, layer in enumerate(plan.layers)}
        col_of = {p: i for i, p in enumerate(plan.positions)}
        queue: asyncio.Queue = asyncio.Queue()

        async def run_cell(cell: Cell) -> None:
            try:
                output = await self._one(plan.tokens, prepared[cell.index], f"cell{cell.index}")
                await queue.put((cell, output, None))
            except Exception as exc:  # noqa: BLE001 - one cell's failure is that cell's error
                await queue.put((cell, None, f"{type(exc).__name__}: {exc}"))

        tasks = [asyncio.create_task(run_cell(cell)) for cell in plan.cells]
        # The corrupt prompt again inside the cells' batch: vLLM is not batch-invariant, so its distance from
        # the solo baseline is the noise floor of every cell.
        baseline_task = asyncio.create_task(self._one(plan.tokens, None, "corrupt-in-batch"))
        try:
            pending: dict[str, tuple[Cell, Any]] = {}
            done = 0
            while done < len(plan.cells):
                cell, output, error = await queue.get()
                batch = [(cell, output, error)]
                while not queue.empty():
                    batch.append(queue.get_nowait())
                finished = {}
                for c, out, err in batch:
                    if err is not None:
                        finished[c.index] = (c, None, err)
                    else:
                        pending[prepared[c.index].key] = (c, out)
                if pending:
                    statuses = await self._statuses({k: prepared[c.index] for k, (c, _) in pending.items()},
                                                    len(plan.tokens))
                    for key, (c, out) in pending.items():
                        status = statuses[key][PATCH_RESULT]
                        finished[c.index] = (c, out, None if status.status == "ok" else status.message)
                    pending.clear()
                for c, out, err in finished.values():
                    done += 1
                    event = {"hook": c.hook, "layer": c.layer, "position": c.position}
                    if err is not None:
                        errors.append({**event, "error": err})
                        yield "cell", {**event, "error": err}
                        continue
                    a, f = _grade(out, plan.answer_id, plan.foil_id)
                    value = _metric(plan.request.metric, a, f, clean or {}, corrupt)
                    grid = grids[c.hook]
                    grid["answer_logprob"][row_of[c.layer]][col_of[c.position]] = a
                    grid["foil_logprob"][row_of[c.layer]][col_of[c.position]] = f
                    grid["metric"][row_of[c.layer]][col_of[c.position]] = value
                    yield "cell", {**event, "answer_logprob": a, "foil_logprob": f, "metric": value}
            in_batch = await baseline_task
        finally:
            for task in [*tasks, baseline_task]:
                task.cancel()
        a, f = _grade(in_batch, plan.answer_id, plan.foil_id)
        noise = {"answer_logprob": abs(a - corrupt["answer_logprob"]),
                 "foil_logprob": abs(f - corrupt["foil_logprob"]) if f is not None else None}
        self.timing["cells_s"] = time.monotonic() - start
        self.timing["cells_per_s"] = len(plan.cells) / max(self.timing["cells_s"], 1e-9)
        yield "summary", {**plan.layout(), "clean": clean, "corrupt": corrupt, "grids": grids, "errors": errors,
                          "noise_floor": noise, "timing": dict(self.timing)}
