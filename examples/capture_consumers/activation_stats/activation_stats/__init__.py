"""An example capture consumer: appends one JSON line of activation statistics per request.

Engine option ``path`` (required): the JSON-lines file to append to. Request option ``note`` (optional): a
string of at most 200 characters, copied into the line. Each line holds the request id, tag, note, the
captured positions and, per site, the mean L2 norm of its rows.
"""

import json
import os
from typing import Any, ClassVar

from vllm_interp.capture.consumer import CaptureConsumer, ConsumerContext, EngineFacts, RequestCapture

MAX_NOTE_LENGTH = 200


class ActivationStatsConsumer(CaptureConsumer):
    name: ClassVar[str] = "activation_stats"

    @classmethod
    def validate_engine_options(cls, options: dict[str, str]) -> dict[str, Any]:
        unknown = options.keys() - {"path"}
        if unknown:
            raise ValueError(f"{min(unknown)}: unknown option")
        if not options.get("path"):
            raise ValueError("path: required (the JSON-lines file to append to)")
        return {"path": options["path"]}

    @classmethod
    def validate_options(cls, options: dict[str, Any], engine: EngineFacts) -> dict[str, Any]:
        unknown = options.keys() - {"note"}
        if unknown:
            raise ValueError(f"{min(unknown)}: unknown option")
        note = options.get("note")
        if note is not None and not (isinstance(note, str) and len(note) <= MAX_NOTE_LENGTH):
            raise ValueError(f"note: must be a string of at most {MAX_NOTE_LENGTH} characters")
        return options

    def __init__(self, context: ConsumerContext) -> None:
        super().__init__(context)
        self.path = context.options["path"]
        # One handle for the worker's lifetime (closed in close()), and no lock: consume runs on the
        # consumer's own thread, one request at a time.
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115

    def consume(self, capture: RequestCapture) -> dict[str, Any]:
        meta = capture.meta
        mean_norms = {
            # None rather than NaN when nothing was captured: NaN is not valid JSON.
            site: rows.float().norm(dim=-1).mean().item() if len(rows) else None
            for site, rows in capture
        }
        line = {
            "request_id": meta.request_id,
            "tag": meta.tag,
            "note": meta.options.get("note"),
            "positions": meta.positions,
            "mean_norm": mean_norms,
        }
        self._file.write(json.dumps(line) + "\n")
        # The caller is told the line is written: make that survive a crash of the host.
        self._file.flush()
        os.fsync(self._file.fileno())
        return {"written": self.path, "sites": len(mean_norms)}

    def close(self) -> None:
        self._file.close()
