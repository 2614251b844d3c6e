"""The ``patch_source`` capture consumer: keeps a request's rows in this worker's source store.

Enabled by ``--enable-patching`` (it needs no ``--capture-consumers`` flag). A request captures into it like
into any consumer (``capture={"patch_source": {"hooks": ..., "positions": ..., "tag": RUN_ID}}``); the rows
become the source run ``tag`` (a generated id without one), which later requests patch from. The result
names the run and its generation; over HTTP it is the ``patch_source`` entry of ``capture_results``.
"""

from typing import Any
from uuid import uuid4

from vllm_interp.capture.consumer import CaptureConsumer, RequestCapture
from vllm_interp.patching.sources import SOURCES, SourceRun

NAME = "patch_source"


class PatchSourceConsumer(CaptureConsumer):
    name = NAME
    every_rank = True  # each tensor-parallel rank patches from its own copy

    def consume(self, capture: RequestCapture) -> dict[str, Any]:
        meta = capture.meta
        run = SourceRun(meta.tag or f"run-{uuid4().hex[:12]}", meta.prompt_len, list(meta.positions),
                        {site: tensor.contiguous() for site, tensor in capture.tensors.items()})
        evicted = SOURCES.put(run)
        return {"run_id": run.run_id, "generation": run.generation, "positions": run.positions,
                "sites": len(run.tensors), "bytes": run.nbytes, "evicted": evicted}

    @classmethod
    def merge_results(cls, results: list[dict[str, Any]]) -> dict[str, Any]:
        """Pipeline stages stored their own layers under one run id (tensor-parallel ranks identical copies,
        counted once): one result with the stages' sums."""
        stages = list({r["generation"]: r for r in results}.values())
        return {**stages[0], "generation": "|".join(r["generation"] for r in stages),
                "sites": sum(r["sites"] for r in stages), "bytes": sum(r["bytes"] for r in stages),
                "evicted": sorted({run for r in stages for run in r["evicted"]})}
