"""The capture-consumer plugin interface.

A consumer is a class registered under the entry-point group ``vllm_interp.capture_consumers`` and enabled
with ``--capture-consumers NAME[:key=val,...]``. Each worker that reports rows (tensor-parallel rank 0 of
every pipeline stage, or every rank for a consumer with ``every_rank``) builds one instance, and runs it on
its own thread: ``consume`` never runs on the forward path, so a slow consumer delays only its own results
(unless the overload policy is ``block``).

Lifecycle, all on the consumer's thread except ``validate_*``:

1. ``validate_engine_options(options)`` (classmethod): check the ``--capture-consumers`` options, before the
   engine starts.
2. ``validate_options(options, engine)`` (classmethod): check a request's consumer options (every field of
   its spec besides hooks/positions/tag/naming), in the frontend (and in each worker for ``--capture-global``),
   against the ``EngineFacts`` of the engine that serves it. Raise ``ValueError("field: why")``.
   ``validate_hooks(hooks, options, engine)`` (classmethod) may choose the sites when the spec names none, or
   refuse sites the consumer cannot take.
3. ``__init__(context)``: once per worker, with the engine options and the model's facts.
4. ``consume(capture)``: once per finished request, with every captured row (or, for a consumer that declares
   a ``row_reduction``, every row's summary, reduced on the device during the step); or, for a request whose
   consumer options make ``part_bytes`` non-zero, once per part while the request runs: each part holds the
   positions landed since the last one (``meta.part`` counts them from 0; ``meta.final`` marks the last, handed
   on when the request ends), and ``merge_parts`` makes the request's one result of theirs. Return a dict (or None) that
   travels to the caller as the result: on the caller's side ``result_from_wire`` (classmethod; default: as is)
   turns it into what the caller receives (offline as is; over HTTP through ``result_to_json``). Tensors
   travel best packed (``capture.packed``). Raise to fail only this request (status ``error``). Copy rows
   you keep past ``consume``: in a process of its own (``isolation.py``) a consumer that keeps them costs
   the worker a fresh shared block for the next request.
5. ``close()``: at engine shutdown, after every queued request was consumed.

Under pipeline parallelism each stage's instance receives that stage's layers; ``merge_results`` combines
the stages' results for the caller.
"""

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, ClassVar

import pybase64
import torch

from vllm_interp.hooks import HOOKS, parse_site_name, site_order
from vllm_interp.sae import SparseAutoencoder


@dataclass(frozen=True)
class EngineFacts:
    """What validating a request may consult about the engine serving it; the frontend and the worker build
    the same facts from the same flags, so a spec validates alike in both (several engines may share a
    process, as offline tests do: the facts travel with the call, never through process state)."""

    num_layers: int
    saes: Mapping[str, SparseAutoencoder] = field(default_factory=dict)  # --sae NAME=DIR, loaded


@dataclass(frozen=True)
class ConsumerContext:
    """What a consumer instance knows about its engine."""

    name: str
    options: dict[str, Any]  # from --capture-consumers, after validate_engine_options
    model: str
    num_layers: int
    hidden_size: int
    pipeline_rank: int = 0  # this stage; it holds only its own layers of every request
    pipeline_size: int = 1
    saes: Mapping[str, SparseAutoencoder] = field(default_factory=dict)  # --sae NAME=DIR, loaded


@dataclass(frozen=True)
class CaptureMeta:
    """Metadata of one request's capture, as a consumer sees it."""

    request_id: str
    tag: str | None
    model: str
    prompt_len: int
    positions: list[int]  # absolute token indices, ascending; rows of every tensor in this order
    sites: list[str]  # "12.post_block" names, layer-major, in tensor order
    dtype: str
    options: dict[str, Any] = field(default_factory=dict)  # the request's consumer options
    part: int = 0  # which part of the request this is (``CaptureConsumer.part_bytes``)
    final: bool = True  # whether it is the request's last part (a request handed on whole is one final part)

    @property
    def in_parts(self) -> bool:
        """Whether the request is handed on in parts (this one among them), not whole."""
        return self.part > 0 or not self.final

    @property
    def layers(self) -> list[int]:
        return site_metadata(self.sites)["layers"]

    @property
    def hooks(self) -> list[str]:
        return site_metadata(self.sites)["hooks"]

    def to_json(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "tag": self.tag,
            "model": self.model,
            "prompt_len": self.prompt_len,
            "positions": self.positions,
            **site_metadata(self.sites),
            "dtype": self.dtype,
            **({"part": self.part, "final": self.final} if self.in_parts else {}),
        }


def site_metadata(sites: list[str]) -> dict[str, Any]:
    """The ``sites``, ``layers`` and ``hooks`` entries of capture metadata for these site names."""
    layers, hooks = _layers_and_hooks(tuple(sites))
    return {"sites": list(sites), "layers": list(layers), "hooks": list(hooks)}


# Every result's metadata names its sites, and most requests capture the same ones: parsed once per set (this
# runs on a consumer's thread beside the forward loop, where every request's Python delays the next step).
@lru_cache(maxsize=1024)
def _layers_and_hooks(sites: tuple[str, ...]) -> tuple[tuple[int, ...], tuple[str, ...]]:
    captured = [parse_site_name(s) for s in sites]
    return (tuple(sorted({layer for layer, _ in captured})),
            tuple(hook for hook in HOOKS if any(h == hook for _, h in captured)))


def merge_stages(
    parts: list[tuple[dict[str, torch.Tensor], dict[str, Any]]],
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """One request's capture from its pipeline stages' ``(tensors, metadata)`` (each stage holds its own
    layers): every tensor in site order, and the first stage's metadata with the sites of the whole."""
    tensors = {name: t for part, _ in parts for name, t in part.items()}
    sites = sorted(tensors, key=site_order)
    return {name: tensors[name] for name in sites}, {**parts[0][1], **site_metadata(sites)}


@dataclass(frozen=True, eq=False)
class RowReduction:
    """What a consumer takes of each row instead of the row: ``reduce`` maps ``[..., hidden]`` rows to
    ``[..., width]`` float32 summaries. The worker applies it on the rows' device to every step's rows, so
    only ``width`` floats per row leave the device and wait for the request to finish (a 16-layer, 2048-wide
    bf16 model captured at every token moves 64 KiB per token as rows, 320 bytes as five statistics). The
    consumer then receives ``[positions, width]`` float32 tensors in place of rows. Compared by identity:
    consumers that share one reduction share its per-step work."""

    name: str
    width: int
    reduce: Callable[[torch.Tensor], torch.Tensor]
    # The same summaries written into a given float32 tensor of the output's shape (optional): a steady batch's
    # steps are reduced into one device block and copied off together (``host_copies.ReducedSteps``).
    reduce_into: Callable[[torch.Tensor, torch.Tensor], None] | None = None

    def reduce_to(self, rows: torch.Tensor, out: torch.Tensor) -> None:
        """Write ``reduce(rows)`` into ``out``: in place where the reduction can (``reduce_into``)."""
        if self.reduce_into is not None:
            self.reduce_into(rows, out)
        else:
            out.copy_(self.reduce(rows))


class SiteTensors(Mapping[str, torch.Tensor]):
    """A ``[sites, positions, width]`` block's tensor per site (in site order), made when one is first asked
    for: a consumer that takes the block whole (``inline``) or reads only the site names never pays for them.
    On a consumer's runner thread every torch call gives up the interpreter lock and waits to take it back from
    the forward loop, so a call saved per request is a handoff saved."""

    def __init__(self, sites: Sequence[str], block: torch.Tensor) -> None:
        if len(sites) != block.shape[0]:
            raise ValueError(f"{len(sites)} site names for a block of {block.shape[0]} sites")
        self._sites, self._block = sites, block
        self._views: dict[str, torch.Tensor] | None = None

    def _by_site(self) -> dict[str, torch.Tensor]:
        if self._views is None:
            self._views = dict(zip(self._sites, self._block.unbind(0), strict=True))
        return self._views

    def __getitem__(self, site: str) -> torch.Tensor:
        return self._by_site()[site]

    def __contains__(self, site: object) -> bool:
        return site in self._sites

    def __iter__(self) -> Iterator[str]:
        return iter(self._sites)

    def __len__(self) -> int:
        return len(self._sites)


@dataclass
class RequestCapture:
    """One request's captured rows: ``tensors["12.post_block"]`` is ``[len(meta.positions), hidden]`` (or
    ``[len(meta.positions), width]`` summaries for a consumer with a ``row_reduction``)."""

    meta: CaptureMeta
    tensors: Mapping[str, torch.Tensor]
    # The ``[sites, positions, width]`` block the tensors are views of, in site order, when they are: a consumer
    # that takes the rows whole uses it instead of stacking them again.
    block: torch.Tensor | None = None

    @classmethod
    def of_block(cls, meta: CaptureMeta, block: torch.Tensor) -> "RequestCapture":
        """The consumer's view of a ``[sites, positions, width]`` block in ``meta.sites``' order."""
        return cls(meta, SiteTensors(meta.sites, block), block)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.tensors.items())

    @property
    def nbytes(self) -> int:
        if self.block is not None:
            return self.block.numel() * self.block.element_size()
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


@dataclass
class PendingCapture:
    """A finished request's capture (or a part of a running one's) before its rows are gathered: ``fill``
    writes them into a ``[len(meta.sites), len(meta.positions), hidden]`` block that the consumer's host
    provides (ordinary or shared memory), on the consumer's runner thread, so the worker's forward loop never
    copies them."""

    meta: CaptureMeta
    hidden: int
    dtype: torch.dtype
    fill: Callable[[torch.Tensor], None]

    @classmethod
    def of(cls, capture: RequestCapture) -> "PendingCapture":
        """One whose rows are already tensors (rows loaded back from a spill file; tests)."""
        tensors = [capture.tensors[site] for site in capture.meta.sites]
        first = tensors[0] if tensors else torch.empty(0, 0)

        def fill(block: torch.Tensor) -> None:
            if tensors:
                torch.stack(tensors, out=block)

        return cls(capture.meta, first.shape[-1], first.dtype, fill)

    @property
    def shape(self) -> tuple[int, int, int]:
        return len(self.meta.sites), len(self.meta.positions), self.hidden

    @property
    def nbytes(self) -> int:
        sites, positions, hidden = self.shape
        return sites * positions * hidden * self.dtype.itemsize


class CaptureConsumer:
    """Base class of capture consumers (see the module docstring for the lifecycle)."""

    name: ClassVar[str] = ""
    # Tensor-parallel ranks hold identical rows, so one rank (0) consumes them; a consumer whose data every
    # rank needs (patch sources, read back on each rank) runs on every rank instead.
    every_rank: ClassVar[bool] = False
    # Where instances run unless ``--capture-consumers NAME:isolation=...`` says: ``process`` keeps heavy work
    # (serialisation, writing, statistics) off the worker's interpreter; ``thread`` suits consumers that
    # share state with the worker (patch sources) or whose result is the rows themselves (inline).
    default_isolation: ClassVar[str] = "thread"
    # Torch's thread count in the consumer's own process (``isolation=process``); None: torch's default, a
    # thread per core. A consumer whose work is copying and writing wants 1: torch splits a large copy across
    # every core, and into memory not touched yet those threads mostly wait on each other's page faults,
    # while taking cores from the engine (H200 host, 8 MiB parts to the sharded layout: the child's copies
    # 0.66 of its time at 16 threads, 0.27 at 1; benchmarks/consumer_handoff.py).
    process_threads: ClassVar[int | None] = None
    # A consumer that needs only a per-row summary names it here (see ``RowReduction``); None: whole rows.
    row_reduction: ClassVar[RowReduction | None] = None

    def __init__(self, context: ConsumerContext) -> None:
        self.context = context

    @classmethod
    def validate_engine_options(cls, options: dict[str, str]) -> dict[str, Any]:
        """Check (and convert) the ``--capture-consumers`` options; default: none accepted."""
        return _no_options(options)

    @classmethod
    def validate_options(cls, options: dict[str, Any], engine: EngineFacts) -> dict[str, Any]:
        """Check (and normalise) a request's consumer options; default: none accepted."""
        return _no_options(options)

    @classmethod
    def part_bytes(cls, options: dict[str, Any]) -> int:
        """For a request with these consumer options (the engine's, updated by the request's): hand its rows on
        in parts of about this many bytes while it runs, so they leave the worker as they are computed instead
        of all when it ends; 0 (the default): in one piece when it ends."""
        return 0

    @classmethod
    def validate_hooks(cls, hooks: Any, options: dict[str, Any], engine: EngineFacts) -> Any:
        """The spec's ``hooks`` (None when the request gave none; then everything, ``"all"``), after the
        consumer's say. Default: whatever the request gave."""
        return "all" if hooks is None else hooks

    def consume(self, capture: RequestCapture) -> dict[str, Any] | None:
        raise NotImplementedError

    def close(self) -> None:
        """Release resources (files, connections) at shutdown."""

    @classmethod
    def merge_parts(cls, results: list[dict[str, Any]]) -> dict[str, Any]:
        """One request's result from what ``consume`` returned for each of its parts, in order (only for
        requests handed on in parts); default: the last part's."""
        return results[-1]

    @classmethod
    def merge_results(cls, results: list[dict[str, Any]]) -> dict[str, Any]:
        """Combine the results of pipeline stages (each consumed its own layers) into the caller's one."""
        return {"stages": results}

    @classmethod
    def result_from_wire(cls, result: dict[str, Any]) -> dict[str, Any]:
        """What ``consume`` returned, as the caller receives it, on the caller's side (before
        ``merge_results``); default: as it came."""
        return result

    @classmethod
    def result_to_json(cls, result: dict[str, Any]) -> dict[str, Any]:
        """The result as JSON for an HTTP response; default: bytes values become base64 text."""
        return {k: pybase64.b64encode_as_string(v) if isinstance(v, bytes) else v for k, v in result.items()}


def _no_options(options: dict[str, Any]) -> dict[str, Any]:
    if options:
        raise ValueError(f"{next(iter(options))}: unknown option")
    return options
