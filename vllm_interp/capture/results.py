"""Per-request, per-consumer capture results: the wire format the caller receives."""

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

Status = Literal["ok", "partial_error", "error"]
_SEVERITY = {"ok": 0, "partial_error": 1, "error": 2}


class ConsumerResult(BaseModel):
    """What one consumer did with one request's rows.

    ``ok``: every selected row was consumed. ``partial_error``: the consumer got the request, but some rows
    were missing or dropped (``message`` says which; ``dropped`` counts them). ``error``: the consumer did
    not store the request (its exception, an overload drop, positions never computed).
    """

    model_config = ConfigDict(extra="forbid")

    status: Status
    message: str | None = None
    result: dict[str, Any] | None = None  # what the consumer returned (inline: the tensors)
    rows: int = 0  # positions x sites handed to the consumer
    dropped: int = 0  # rows lost to the overload policy or the per-step row budget
    spilled: int = 0  # rows that waited on disk (overload policy spill)

    @classmethod
    def failed(cls, message: str, *, dropped: int = 0) -> "ConsumerResult":
        return cls(status="error", message=message, dropped=dropped)

    def as_dict(self) -> dict[str, Any]:
        """The fields as a dict, the payload as it is: ``model_dump`` would rebuild every list of a payload
        (41,000 floats of every-token statistics: 0.75-1.7 ms a request on the dev CPU, on the worker and again on
        the API server)."""
        return {**self.model_dump(exclude={"result"}), "result": self.result}


def worst_status(statuses: list[Status]) -> Status:
    return max(statuses, key=_SEVERITY.__getitem__)


def merge_consumer_results(parts: list[ConsumerResult], merge_payloads: Any) -> ConsumerResult:
    """One result from several of the same consumer for the same request: its pipeline stages' (each consumed
    its own layers), or the parts it was handed on in (``CaptureConsumer.part_bytes``)."""
    if len(parts) == 1:
        return parts[0]
    messages = [p.message for p in parts if p.message]
    payloads = [p.result for p in parts if p.result is not None]
    return ConsumerResult(
        status=worst_status([p.status for p in parts]),
        message="; ".join(messages) or None,
        result=merge_payloads(payloads) if payloads else None,
        rows=sum(p.rows for p in parts),
        dropped=sum(p.dropped for p in parts),
        spilled=sum(p.spilled for p in parts),
    )


class ResultCollector:
    """Gathers the workers' answers for a set of capture keys over repeated ``interp_capture_results`` calls
    (each worker answers a key once all its consumers are done with it) and merges them per consumer."""

    def __init__(self, lengths: dict[str, int | None], requested: dict[str, list[str]]) -> None:
        self.lengths = lengths  # capture key -> final sequence length (None: asked for while it may still run)
        self.requested = requested  # capture key -> consumer names the request asked for
        self._answers: dict[str, dict[int, dict[str, Any]]] = {key: {} for key in lengths}
        self._num_ranks: int | None = None

    @property
    def pending(self) -> dict[str, int | None]:
        ranks = self._num_ranks
        return {k: n for k, n in self.lengths.items() if ranks is None or len(self._answers[k]) < ranks}

    def add(self, per_rank: list[dict[str, dict[str, Any]]]) -> None:
        self._num_ranks = len(per_rank)
        for rank, done in enumerate(per_rank):
            for key, result in done.items():
                self._answers[key][rank] = result

    def merged(self, consumers: dict[str, Any]) -> dict[str, dict[str, ConsumerResult]]:
        """Per key, per requested consumer: the stages' results, each payload unpacked (by the consumer class's
        ``result_from_wire``) and then merged (by its ``merge_results``; ``consumers`` maps names to classes), or
        an error saying why none came."""
        pending = self.pending
        merged = {}
        for key, names in self.requested.items():
            by_rank = self._answers[key].values()
            results = {}
            for name in names:
                parts = [_from_wire(ConsumerResult.model_validate(r[name]), consumers[name]) for r in by_rank
                         if name in r]
                if key in pending:
                    results[name] = ConsumerResult.failed("the consumer did not finish in time")
                elif not parts:
                    results[name] = ConsumerResult.failed(
                        "no rows: the request never reached the model (aborted or rejected before its first step)"
                    )
                else:
                    results[name] = merge_consumer_results(parts, consumers[name].merge_results)
            merged[key] = results
        return merged


def _from_wire(result: ConsumerResult, consumer: Any) -> ConsumerResult:
    """A rank's result with its payload as the caller receives it (the consumer class's ``result_from_wire``)."""
    if result.result is None:
        return result
    return result.model_copy(update={"result": consumer.result_from_wire(result.result)})


def result_to_json(result: ConsumerResult, payload_to_json: Any) -> dict[str, Any]:
    """A result as JSON; ``payload_to_json`` (the consumer's ``result_to_json``) converts its payload."""
    data = result.as_dict()
    if data["result"] is not None:
        data["result"] = payload_to_json(data["result"])
    return data
