"""Filesystem captures as a SAELens cached-activation dataset (``vllm-interp export-saelens``).

SAELens (6.x) trains from cached activations through ``ActivationsStore(cached_activations_path=DIR)``: it
opens ``DIR`` with ``datasets.load_from_disk``, keeps the column named by its ``hook_name`` (plus ``token_ids``
if present) and requires that column's feature to be an ``Array2D`` of shape ``(context_size, d_in)``. Its
``CacheActivationsRunner`` writes exactly that, with a ``token_ids`` column typed ``Sequence(Value("int32"),
length=context_size)``, and no other file beside the dataset. :func:`export_saelens` writes the same layout
from the captures under a ``filesystem`` consumer root:

- one ``Array2D((context_size, hidden), dtype)`` column per exported site, named in TransformerLens style
  (``12.post_block`` becomes ``blocks.12.hook_resid_post``), columns in site order (layer, then hook);
- rows: the captures in ``list_captures`` order (their bases, sorted as strings), each capture's rows in
  position order, concatenated into one stream and cut into sequences of ``context_size`` rows. A sequence may
  therefore span two requests, as SAELens's own token batching spans documents. The trailing rows that do not
  fill a sequence (fewer than ``context_size``) are dropped and counted in the result's ``dropped``;
- no ``token_ids`` column: capture metadata carries positions, not token ids, and SAELens reads the column only
  if present (without it, it cannot drop special tokens' rows, so capture only the positions you want).

Every capture must hold every exported site with the same hidden size. Exporting the default (every captured
site) also requires every capture to hold the same sites as the first; choosing ``sites`` exports those from
captures that hold more. The dataset is built under a hidden temporary directory beside ``out`` and renamed
into place, so ``out`` appears complete or not at all.
"""

import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vllm_interp.capture.consumers.filesystem import list_captures, read_capture
from vllm_interp.hooks import parse_site_name, site_name, site_order

DTYPES = ("float32", "float16", "float64")  # Arrow has no bfloat16: bfloat16 captures widen exactly to float32


class SaelensExportError(ValueError):
    """A root, site choice or option that cannot be exported; the message names the capture or value at fault."""


@dataclass(frozen=True)
class SaelensExport:
    """What :func:`export_saelens` wrote."""

    path: Path
    columns: list[str]  # TransformerLens hook names, one Array2D column each
    context_size: int
    d_in: int
    sequences: int  # dataset rows
    captures: int
    dropped: int  # trailing captured rows that did not fill a sequence


@dataclass
class _Job:
    """The generator's input and its running totals (the generator runs inside ``datasets``)."""

    root: Path
    bases: list[str]
    columns: list[str]
    same_sites: frozenset[str] | None  # the site set every capture must hold exactly, when exporting all
    context_size: int
    d_in: int
    dtype: str
    rows: int = 0
    sequences: int = 0
    leftover: int = 0
    error: SaelensExportError | None = None


def export_saelens(
    root: str | os.PathLike,
    out: str | os.PathLike,
    *,
    context_size: int,
    sites: Iterable[str] | None = None,
    dtype: str = "float32",
) -> SaelensExport:
    """Write every complete capture under ``root`` to ``out`` as a SAELens cached-activation dataset (see the
    module docstring for the layout and row order).

    ``sites``: the sites to export, in either spelling (``3.post_block`` or ``blocks.3.hook_resid_post``);
    default: every site the captures hold. ``dtype``: the stored dtype, one of ``float32``, ``float16``,
    ``float64`` (SAELens converts to its own ``dtype`` on load). ``out`` must not exist or be an empty
    directory. Raises :class:`SaelensExportError` for an empty root, an unknown site, ``context_size < 1``,
    captures that disagree on sites or hidden size, or fewer rows than one sequence; ``ImportError`` without
    the ``datasets`` package (the ``saelens`` extra).
    """
    datasets = _import_datasets()
    if isinstance(context_size, bool) or not isinstance(context_size, int) or context_size < 1:
        raise SaelensExportError(f"context_size: must be an integer >= 1 (got {context_size!r})")
    if dtype not in DTYPES:
        raise SaelensExportError(f"dtype: must be one of {', '.join(DTYPES)} (got {dtype!r})")
    root, out = Path(root), Path(out)
    bases = list_captures(root)
    if not bases:
        why = "" if root.is_dir() else " (no such directory)"
        raise SaelensExportError(f"no complete captures under {root}{why}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not an empty directory")

    tensors, meta = read_capture(root, bases[0])
    captured = _transformer_lens_sites(meta["sites"])
    columns = _chosen_columns(sites, captured, bases[0])
    job = _Job(root, bases, columns, None if sites is not None else frozenset(captured), context_size,
               d_in=next(iter(tensors.values())).shape[-1], dtype=dtype)
    features = datasets.Features({c: datasets.Array2D(shape=(context_size, job.d_in), dtype=dtype) for c in columns})

    out.parent.mkdir(parents=True, exist_ok=True)
    # Beside out (same filesystem), so the finished dataset is renamed into place rather than copied.
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        try:
            dataset = datasets.Dataset.from_generator(
                _sequences, features=features, cache_dir=str(work / "cache"), gen_kwargs={"job": job})
        except datasets.exceptions.DatasetGenerationError:
            # datasets wraps whatever the generator raises; a refused capture should read as itself.
            if job.error is not None:
                raise job.error from None
            raise
        dataset.save_to_disk(str(work / "dataset"))
        os.replace(work / "dataset", out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return SaelensExport(out, columns, context_size, job.d_in, len(dataset), len(bases), job.leftover)


def _sequences(job: _Job) -> Iterator[dict[str, Any]]:
    """The dataset's rows: every capture's rows, concatenated in order, cut into ``context_size`` blocks."""
    torch_dtype = getattr(torch, job.dtype)
    pending = {c: np.empty((0, job.d_in), dtype=job.dtype) for c in job.columns}
    for base in job.bases:
        tensors, meta = read_capture(job.root, base)
        by_column = {_transformer_lens_name(site): site for site in meta["sites"]}
        problem = _mismatch(job, base, by_column, tensors)
        if problem is not None:
            job.error = SaelensExportError(problem)
            raise job.error
        for column in job.columns:
            rows = tensors[by_column[column]].to(torch_dtype).numpy()
            pending[column] = np.concatenate([pending[column], rows])
        job.rows += len(meta["positions"])
        full = len(pending[job.columns[0]]) // job.context_size
        job.sequences += full
        for i in range(full):
            block = slice(i * job.context_size, (i + 1) * job.context_size)
            yield {c: pending[c][block] for c in job.columns}
        pending = {c: rows[full * job.context_size:] for c, rows in pending.items()}
    job.leftover = len(pending[job.columns[0]])
    if not job.sequences:
        # datasets cannot build a dataset of no rows; say why there are none.
        job.error = SaelensExportError(f"the captures under {job.root} hold {job.rows} rows, fewer than one "
                                       f"sequence of context_size {job.context_size}")
        raise job.error


def _mismatch(job: _Job, base: str, by_column: dict[str, str], tensors: dict[str, torch.Tensor]) -> str | None:
    """Why capture ``base`` cannot join the export, or None."""
    if job.same_sites is not None and set(by_column) != job.same_sites:
        return (f"capture {base!r} holds sites {_listed(by_column)} but {job.bases[0]!r} holds "
                f"{_listed(job.same_sites)}; choose the sites to export (--sites) from those every capture holds")
    missing = [c for c in job.columns if c not in by_column]
    if missing:
        return f"capture {base!r} lacks the exported site(s) {', '.join(missing)} (it holds {_listed(by_column)})"
    for column in job.columns:
        hidden = tensors[by_column[column]].shape[-1]
        if hidden != job.d_in:
            return f"capture {base!r}: {column} has hidden size {hidden}, not {job.d_in} like {job.bases[0]!r}"
    return None


def _chosen_columns(sites: Iterable[str] | None, captured: list[str], first: str) -> list[str]:
    if sites is None:
        return captured
    chosen: list[str] = []
    for name in [sites] if isinstance(sites, str) else sites:
        try:
            column = _transformer_lens_name(name)
        except ValueError as exc:
            raise SaelensExportError(f"sites: {exc}") from None
        if column not in captured:
            raise SaelensExportError(f"sites: unknown site {name!r}: capture {first!r} holds {_listed(captured)}")
        if column not in chosen:
            chosen.append(column)
    if not chosen:
        raise SaelensExportError("sites: empty (leave it out to export every captured site)")
    return sorted(chosen, key=site_order)


def _transformer_lens_sites(names: Iterable[str]) -> list[str]:
    """Site names (either spelling) as TransformerLens hook names, in site order."""
    return sorted(map(_transformer_lens_name, names), key=site_order)


def _transformer_lens_name(name: str) -> str:
    return site_name(*parse_site_name(name), naming="transformer_lens")


def _listed(sites: Iterable[str]) -> str:
    return ", ".join(sorted(sites, key=site_order))


def _import_datasets() -> Any:
    try:
        import datasets
    except ImportError as exc:
        raise ImportError("the SAELens export needs `datasets`: pip install 'vllm-interp[saelens]'") from exc
    return datasets
