"""The built-in ``filesystem`` capture consumer: each request's rows as safetensors files under one root.

Enable with ``--capture-consumers filesystem:root=DIR[,layout=packed][,on_collision=error][,shard_mb=256][,part_mb=8]``.
A request's files are named by its ``base``: its ``tag`` if given, else its request id made file-safe
(:func:`request_base`). Every tensor is ``[len(positions), hidden]`` and is named by its site (``12.post_block``).

Layouts (``layout``; a request may override it and ``on_collision`` in its spec):

- ``per_file``: ``<root>/<base>/<site>.safetensors`` (one tensor each) and the sidecar ``<root>/<base>/meta.json``.
- ``packed``: ``<root>/<base>.safetensors`` (one tensor per site) and the sidecar ``<root>/<base>.json``.
- ``sharded``: requests are buffered in memory and written together to ``<root>/shards/shard-NNNNN.safetensors``
  (tensors ``<base>/<site>``) when the next request would push the shard past ``shard_mb`` MiB (a request that
  alone fills a shard is handed on at once), and at ``close()``; one JSON line per request (the metadata plus
  ``shard``) is then appended to ``<root>/shards/index.jsonl``; the last line of a base wins. The rows
  buffered are the tensors ``consume`` is given, not copies (a consumer in its own process keeps their shared
  block lent until its shard is published: capture/isolation.py). A full shard goes to two threads of their
  own while the next one fills: one writes a shard's data while the other syncs and publishes the shard before
  it, so the disk always has a shard to write (up to three shards' rows are in memory: one filling, two with
  the writers). ``consume`` returns ``pending: true``: its data is durable once its shard is published and its
  index line appended (by the writers, after a later rollover, or at ``close()``), and is lost if the process
  dies before that. Shards are published in order: one whose write or publish fails stops those after it,
  their requests all go back to the buffer for the next shard, and the request whose rollover found the
  failure gets the error.
  A request is taken in parts of about ``part_mb`` MiB (default 8; 0: whole, when it ends) while it runs, so its
  rows leave the engine as they are computed (``CaptureConsumer.part_bytes``): part ``k`` is stored as tensors
  ``<base>/<capture>.<k>/<site>`` (``capture``: a random id per request) with an index line of its own that
  carries ``capture``, ``part`` and ``final``. A capture in parts is complete once its final part's line is
  appended; readers join its parts by position (``read_capture``), and a capture whose final part never came
  (the process died) is not listed.

The metadata (``CaptureMeta.to_json()`` plus ``base``, ``layout`` and ``shape``) is the sidecar / index line, and
is also stored as JSON in each safetensors header under the key ``vllm_interp`` (a shard stores its requests').

Crash safety: every file is written to a hidden ``.<name>.<random>.tmp`` beside its final name, fsynced, renamed
into place, and its directory fsynced. Data files are published before the sidecar or index line that declares
them, and an overwrite deletes the old sidecar first, so a capture is complete exactly when its sidecar or index
line exists. Readers ignore everything else (temp leftovers, data without a sidecar). One consumer instance is
assumed to be the only writer of a root.
"""

import copy
import ctypes
import functools
import itertools
import json
import os
import re
import secrets
import struct
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from vllm_interp.capture.consumer import CaptureConsumer, ConsumerContext, EngineFacts, RequestCapture, merge_stages
from vllm_interp.hooks import parse_site_name

LAYOUTS = ("per_file", "packed", "sharded")
COLLISION_POLICIES = ("overwrite", "error", "suffix")
REQUEST_OPTIONS: dict[str, tuple[str, ...]] = {"layout": LAYOUTS, "on_collision": COLLISION_POLICIES}
DEFAULT_OPTIONS: dict[str, Any] = {"layout": "packed", "on_collision": "error", "shard_mb": 256, "part_mb": 8}
SHARD_DIR = "shards"
INDEX_NAME = "index.jsonl"
PER_FILE_SIDECAR = "meta.json"
METADATA_KEY = "vllm_interp"
STAGE_PREFIX = "pp-stage-"

_UNSAFE_CHARS = re.compile(r"[^A-Za-z0-9_.\-]")
_MAX_SEGMENT = 128  # the tag rule's segment limit, so a request id makes a base no longer than a tag segment
_SHARD_NAME = re.compile(r"shard-(\d+)\.safetensors")
_SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


@dataclass
class _Pending:
    tensors: dict[str, torch.Tensor]
    meta: dict[str, Any]
    nbytes: int


class FilesystemConsumer(CaptureConsumer):
    """Writes each request's capture under ``root`` (see the module docstring for the layouts)."""

    name = "filesystem"
    default_isolation = "process"  # serialising and writing are CPU and disk work
    process_threads = 1  # serialises and writes (CaptureConsumer.process_threads)

    def __init__(self, context: ConsumerContext) -> None:
        super().__init__(context)
        options = {**DEFAULT_OPTIONS, **context.options}
        self.root = Path(options["root"])
        if context.pipeline_size > 1:
            # Each pipeline stage holds its own layers of every request: one subtree per stage, merged on read.
            self.root = self.root / f"{STAGE_PREFIX}{context.pipeline_rank}"
        self.layout: str = options["layout"]
        self.on_collision: str = options["on_collision"]
        self.shard_bytes = int(options["shard_mb"]) << 20
        self._open_parts: dict[str, tuple[str, str]] = {}  # request id -> (base, capture id) of a capture in parts
        _make_dirs(self.root)
        self._pending: dict[str, _Pending] = {}
        self._next_shard = _next_shard_number(self.root / SHARD_DIR)
        # Full shards are written and published on threads of their own while the next one fills (writes and
        # syncs release the interpreter lock), so taking requests waits for the disk only past WRITER_DEPTH
        # shards: (data writer, publisher), and each outstanding shard's publish and requests, oldest first.
        self._writers: tuple[ThreadPoolExecutor, ThreadPoolExecutor] | None = None
        self._writing: deque[tuple[Future, dict[str, _Pending]]] = deque()

    @classmethod
    def validate_engine_options(cls, options: dict[str, str]) -> dict[str, Any]:
        """``root`` (required), ``layout``, ``on_collision``, ``shard_mb``, ``part_mb``; returns them converted,
        defaults filled."""
        for key in options:
            if key != "root" and key not in DEFAULT_OPTIONS:
                raise ValueError(f"{key}: unknown option")
        per_request = _checked_request_options({k: v for k, v in options.items() if k in REQUEST_OPTIONS})
        return {
            **DEFAULT_OPTIONS,
            **per_request,
            "root": _checked_root(options.get("root")),
            "shard_mb": _checked_mb("shard_mb", options.get("shard_mb", DEFAULT_OPTIONS["shard_mb"]), least=1),
            "part_mb": _checked_mb("part_mb", options.get("part_mb", DEFAULT_OPTIONS["part_mb"]), least=0),
        }

    @classmethod
    def validate_options(cls, options: dict[str, Any], engine: EngineFacts) -> dict[str, Any]:
        """A request may set ``layout``, ``on_collision`` and ``part_mb``; the engine's values apply otherwise."""
        return _checked_request_options(options)

    @classmethod
    def part_bytes(cls, options: dict[str, Any]) -> int:
        """The sharded layout takes a request in parts of ``part_mb``; the others write it whole."""
        if options.get("layout") != "sharded":
            return 0
        return int(options.get("part_mb", DEFAULT_OPTIONS["part_mb"])) << 20

    def consume(self, capture: RequestCapture) -> dict[str, Any]:
        meta_in = capture.meta
        options = {"layout": self.layout, "on_collision": self.on_collision, **meta_in.options}
        layout = options["layout"]
        shape = self._checked_shape(capture)
        in_parts = meta_in.in_parts
        if meta_in.part:  # a later part: written under the base its first part claimed
            if meta_in.request_id not in self._open_parts:
                raise ValueError(f"part {meta_in.part} of {meta_in.request_id!r}: its first part was not stored")
            base, capture_id = self._open_parts[meta_in.request_id]
        else:
            base = meta_in.tag or request_base(meta_in.request_id)
            self._check_placement(base, layout)
            base = self._claim(base, layout, options["on_collision"])
            if in_parts and meta_in.request_id in self._open_parts:
                raise ValueError(f"request id {meta_in.request_id!r} already has a capture in parts under way")
            capture_id = secrets.token_hex(4)
        meta = {**meta_in.to_json(), "base": base, "layout": layout, "shape": shape,
                **({"capture": capture_id} if in_parts else {})}
        tensors = {site: capture.tensors[site].detach().cpu().contiguous() for site in meta_in.sites}
        if layout == "sharded":
            written = self._write_sharded(base, f"{base}/{capture_id}.{meta_in.part}" if in_parts else base, tensors,
                                          meta)
            if meta_in.final:
                self._open_parts.pop(meta_in.request_id, None)
            elif not meta_in.part:
                self._open_parts[meta_in.request_id] = (base, capture_id)
            return written
        return self._write_files(base, layout, tensors, meta)

    @classmethod
    def merge_parts(cls, results: list[dict[str, Any]]) -> dict[str, Any]:
        """A request written in parts: the last part's result, with every shard file and byte of them all."""
        files = list(dict.fromkeys(path for result in results for path in result["files"]))
        return {**results[-1], "files": files, "bytes": sum(r["bytes"] for r in results),
                "pending": any(r["pending"] for r in results), "parts": len(results)}

    def close(self) -> None:
        """Publish the shard still in memory; if that fails the buffer is kept, so a second close can retry."""
        self._flush()
        self.wait_written()
        if self._writers is not None:
            for writer in self._writers:
                writer.shutdown()
            self._writers = None

    def wait_written(self, keep: int = 0) -> None:
        """Wait until at most ``keep`` shards are with the writers. If one failed, its requests and those of
        every shard after it (which it stopped) go back to the front of the buffer, in order (the next shard,
        or a second close, retries them), and its error is raised."""
        while len(self._writing) > keep:
            published, batch = self._writing[0]
            try:
                published.result()
            except BaseException:
                failed, self._writing = self._writing, deque()
                for later, _ in failed:
                    later.exception()  # stopped by the failure: let it finish before its requests are retried
                self._pending = {key: p for _, shard in failed for key, p in shard.items()} | self._pending
                raise
            self._writing.popleft()

    def _let_go_of_written(self) -> None:
        """Drop the rows of shards already published (failures stay for ``wait_written`` to raise)."""
        while self._writing and self._writing[0][0].done() and self._writing[0][0].exception() is None:
            self._writing.popleft()

    # -- placement and collisions ------------------------------------------------------------------------------

    def _check_placement(self, base: str, layout: str) -> None:
        _check_inside(self.root, base)
        if layout == "sharded":
            # The base only names tensors; the files written are the shard directory's, which a link placed
            # there must not carry out of root (the index is appended to in place, so it must not be a link).
            shards = self.root / SHARD_DIR
            if not shards.resolve().is_relative_to(self.root.resolve()) or (shards / INDEX_NAME).is_symlink():
                raise ValueError(f"root: {shards} or its {INDEX_NAME} is a link leading outside the capture root")
            return
        segments = base.split("/")
        if segments[0] == SHARD_DIR:
            raise ValueError(f"tag: {SHARD_DIR!r} is reserved for the sharded layout's files")
        # Anything written inside a per_file capture's directory would read as one of its files.
        for depth in range(1, len(segments)):
            if (self.root.joinpath(*segments[:depth]) / PER_FILE_SIDECAR).exists():
                raise ValueError(f"tag: {base!r} lies inside the per_file capture {'/'.join(segments[:depth])!r}")

    def _claim(self, base: str, layout: str, policy: str) -> str:
        """The base the request is written under, after the collision policy."""
        if not self._taken(base, layout):
            return base
        if policy == "suffix":
            return next(f"{base}-{n}" for n in itertools.count(1) if not self._taken(f"{base}-{n}", layout))
        if policy == "overwrite" and self._replaceable(base, layout):
            return base
        why = (
            "overwrite replaces only a capture of the same layout and base"
            if policy == "overwrite"
            else "set on_collision to overwrite or suffix to write it anyway"
        )
        raise FileExistsError(f"capture {base!r} already exists under {self.root} ({why})")

    def _taken(self, base: str, layout: str) -> bool:
        packed_data, packed_sidecar = _packed_files(self.root, base)
        directory = self.root / base
        return (
            packed_data.exists()
            or packed_sidecar.exists()
            or (directory / PER_FILE_SIDECAR).exists()
            or base in self._sharded_bases
            or (layout == "per_file" and any(_visible(directory)))
        )

    def _replaceable(self, base: str, layout: str) -> bool:
        """Whether everything at ``base`` belongs to a capture (or the debris of one) of this layout and base."""
        packed_data, packed_sidecar = _packed_files(self.root, base)
        directory = self.root / base
        per_file_sidecar = directory / PER_FILE_SIDECAR
        if layout == "sharded":
            return not (packed_data.exists() or packed_sidecar.exists() or per_file_sidecar.exists())
        if base in self._sharded_bases:
            return False
        if layout == "packed":
            return not per_file_sidecar.exists() and _owned_or_absent(packed_sidecar, layout, base)
        only_own_files = all(
            path.is_file() and (path.name == PER_FILE_SIDECAR or _is_site_file(path)) for path in _visible(directory)
        )
        return (
            not (packed_data.exists() or packed_sidecar.exists())
            and only_own_files
            and _owned_or_absent(per_file_sidecar, layout, base)
        )

    @cached_property
    def _sharded_bases(self) -> set[str]:
        return set(_read_index(self.root))

    def _checked_shape(self, capture: RequestCapture) -> list[int]:
        first = next(iter(capture.tensors.values()), None)
        shape = [len(capture.meta.positions), self.context.hidden_size if first is None else first.shape[-1]]
        if set(capture.tensors) != set(capture.meta.sites):
            raise ValueError(f"capture of {capture.meta.request_id!r}: tensors do not match meta.sites")
        for site, tensor in capture.tensors.items():
            if list(tensor.shape) != shape:
                raise ValueError(f"capture of {capture.meta.request_id!r}: {site} is {list(tensor.shape)}, not {shape}")
        return shape

    # -- writing ---------------------------------------------------------------------------------------------

    def _write_files(
        self, base: str, layout: str, tensors: dict[str, torch.Tensor], meta: dict[str, Any]
    ) -> dict[str, Any]:
        data_files, sidecar = _layout_files(self.root, layout, base, list(tensors))
        _make_dirs(sidecar.parent)
        # Without its sidecar an overwritten capture reads as incomplete until the new one is fully published.
        _remove(sidecar)
        if layout == "packed":
            _publish(data_files[0], _safetensors_writer(tensors, meta))
        else:
            _publish_all([(path, _safetensors_writer({site: tensor}, meta))
                          for path, (site, tensor) in zip(data_files, tensors.items(), strict=True)])
            for stale in {p for p in _visible(sidecar.parent) if _is_site_file(p)} - set(data_files):
                _remove(stale)
        _publish(sidecar, _json_writer(meta))
        files = [*data_files, sidecar]
        return {
            "layout": layout,
            "base": base,
            "path": str(data_files[0] if layout == "packed" else sidecar.parent),
            "files": [str(p) for p in files],
            "bytes": sum(p.stat().st_size for p in files),
        }

    def _write_sharded(self, base: str, key: str, tensors: dict[str, torch.Tensor],
                       meta: dict[str, Any]) -> dict[str, Any]:
        """Buffer a request (or a part of one) as the tensors ``<key>/<site>`` of the next shard."""
        self._let_go_of_written()
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        if self._pending and self._pending_bytes + nbytes > self.shard_bytes:
            self._flush()
        shard = _shard_path(self.root, self._next_shard)
        self._pending[key] = _Pending(tensors, meta, nbytes)
        if self._pending_bytes >= self.shard_bytes:
            try:
                self._flush()
            except BaseException:
                # Only this request fails; the buffer stays within shard_bytes for the next try.
                del self._pending[key]
                raise
        self._sharded_bases.add(base)
        return {
            "layout": "sharded",
            "base": base,
            "shard": shard.name,
            "pending": True,  # in the buffer, or in the writer's hands: durable once its index line is appended
            "path": str(shard),
            "files": [str(shard)],
            "bytes": nbytes,
        }

    @property
    def _pending_bytes(self) -> int:
        return sum(p.nbytes for p in self._pending.values())

    def _flush(self) -> None:
        """Hand the buffered requests to the writers as the next shard, once fewer than ``WRITER_DEPTH`` shards
        are with them (raising, with the failed shards' requests back in the buffer, if one failed)."""
        self.wait_written(keep=WRITER_DEPTH - 1)
        if not self._pending:
            return
        shard = _shard_path(self.root, self._next_shard)
        self._next_shard += 1
        batch, self._pending = self._pending, {}
        if self._writers is None:
            self._writers = (ThreadPoolExecutor(1, thread_name_prefix="vllm-interp-shard-writer"),
                             ThreadPoolExecutor(1, thread_name_prefix="vllm-interp-shard-publisher"))
        data_writer, publisher = self._writers
        records = [{**p.meta, "shard": shard.name} for p in batch.values()]
        written = data_writer.submit(_write_shard, shard, batch, records)
        before = self._writing[-1][0] if self._writing else None
        self._writing.append((publisher.submit(_publish_shard, shard, written, before, records), batch))


# Shards with the writers before a rollover waits: one's data is written while the one before it is synced and
# published (an fsync and a rename the data writer would otherwise wait out with the disk idle).
WRITER_DEPTH = 2


def _write_shard(shard: Path, batch: dict[str, _Pending], records: list[dict[str, Any]]) -> Path:
    """Write one shard of requests to a temporary file beside it (returned; removed if the write fails)."""
    _make_dirs(shard.parent)
    tensors = {f"{key}/{site}": t for key, p in batch.items() for site, t in p.tensors.items()}
    tmp = _temp_name(shard)
    try:
        _safetensors_writer(tensors, {"layout": "sharded", "requests": records})(tmp)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def _publish_shard(shard: Path, written: Future, before: Future | None, records: list[dict[str, Any]]) -> None:
    """Publish a written shard, then append its requests' index lines (the lines declare complete data);
    not if the shard before it failed (the publisher runs shards in order: ``before`` has finished)."""
    tmp = written.result()
    if before is not None and before.exception() is not None:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"{shard.name}: not published, as the shard before it failed")
    _install([(tmp, shard)])
    _append_lines(shard.parent / INDEX_NAME, records)


# -- naming ------------------------------------------------------------------------------------------------------


def request_base(request_id: str) -> str:
    """A request id as one safe file-name segment: characters other than letters, digits, '_', '.', '-' become
    '_', a leading '.' or '-' gets a '_' prefix (so it is never hidden or '..'), at most 128 characters."""
    safe = _UNSAFE_CHARS.sub("_", request_id)
    if not safe or safe[0] in ".-":
        safe = "_" + safe
    return safe[:_MAX_SEGMENT]


def _is_safe_base(base: str) -> bool:
    return all(s and not s.startswith(".") and "\\" not in s and "\0" not in s for s in base.split("/"))


def _check_inside(root: Path, base: str) -> None:
    """Refuse a base that is absolute, has '.'/'..'/hidden segments, or leaves root through a link."""
    if not _is_safe_base(base):
        raise ValueError(f"tag: {base!r} is not a relative path of plain, non-hidden segments")
    if not (root / base).resolve().is_relative_to(root.resolve()):
        raise ValueError(f"tag: {base!r} resolves outside the capture root {root}")


def _layout_files(root: Path, layout: str, base: str, sites: list[str]) -> tuple[list[Path], Path]:
    """(data files, sidecar) of a per_file or packed capture."""
    if layout == "packed":
        data, sidecar = _packed_files(root, base)
        return [data], sidecar
    directory = root / base
    return [directory / f"{site}.safetensors" for site in sites], directory / PER_FILE_SIDECAR


def _packed_files(root: Path, base: str) -> tuple[Path, Path]:
    return root / f"{base}.safetensors", root / f"{base}.json"


def _shard_path(root: Path, number: int) -> Path:
    return root / SHARD_DIR / f"shard-{number:05d}.safetensors"


def _next_shard_number(shard_dir: Path) -> int:
    numbers = [int(m.group(1)) for p in _visible(shard_dir) if (m := _SHARD_NAME.fullmatch(p.name))]
    return max(numbers, default=-1) + 1


def _is_site_file(path: Path) -> bool:
    if path.suffix != ".safetensors":
        return False
    try:
        parse_site_name(path.stem)
    except ValueError:
        return False
    return True


def _visible(directory: Path) -> list[Path]:
    """A directory's entries other than hidden ones (temp files); none if it is not a directory."""
    if not directory.is_dir():
        return []
    return [p for p in directory.iterdir() if not p.name.startswith(".")]


# -- option checks ---------------------------------------------------------------------------------------------


def _checked_root(value: str | None) -> str:
    if not value:
        raise ValueError("root: required (the directory the captures are written under)")
    root = Path(value).expanduser().absolute()
    if root.exists() and not root.is_dir():
        raise ValueError(f"root: {root} exists and is not a directory")
    return str(root)


def _checked_request_options(options: dict[str, Any]) -> dict[str, Any]:
    for key, value in options.items():
        if key == "part_mb":  # a request's own part size (0: whole); the engine's is a flag string
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"part_mb: must be a non-negative integer (got {value!r})")
            continue
        allowed = REQUEST_OPTIONS.get(key)
        if allowed is None:
            raise ValueError(f"{key}: unknown option")
        if not isinstance(value, str) or value not in allowed:
            raise ValueError(f"{key}: must be one of {', '.join(allowed)} (got {value!r})")
    return dict(options)


def _checked_mb(name: str, value: str | int, least: int) -> int:
    try:
        mb = int(value)
    except ValueError:
        mb = -1
    if mb < least:
        kind = "a positive integer" if least else "a non-negative integer"
        raise ValueError(f"{name}: must be {kind} (got {value!r})")
    return mb


# -- durable file writes -------------------------------------------------------------------------------------------


def _safetensors_writer(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> Callable[[Path], None]:
    """Writes a safetensors file straight from the tensors' memory (safetensors' own ``save_file`` first copies
    every tensor into a bytes object: one more pass over what may be a shard of hundreds of MiB)."""
    # "format": "pt" is what Hugging Face loaders expect in a torch safetensors header.
    header: dict[str, Any] = {"__metadata__": {"format": "pt", METADATA_KEY: json.dumps(meta)}}
    offset = 0
    for name, tensor in tensors.items():
        if tensor.dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(f"{name}: dtype {tensor.dtype} has no safetensors name here")
        end = offset + tensor.numel() * tensor.element_size()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, end]}
        offset = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned

    def write(tmp: Path) -> None:
        with open(tmp, "wb", buffering=0) as f:
            written = _write_all(f.fileno(), memoryview(struct.pack("<Q", len(text)) + text))
            started = 0  # the bytes the disk was told to start writing
            for tensor in tensors.values():
                if tensor.numel():
                    written += _write_all(f.fileno(),
                                          memoryview(tensor.contiguous().view(-1).view(torch.uint8).numpy()))
                if written - started >= WRITEBACK_BYTES:
                    _start_writeback(f.fileno(), started, written - started)
                    started = written

    return write


# A file's pages go to the disk as they are written, a chunk at a time, not all at its fsync: the kernel starts
# writing dirty pages back only past a share of the machine's memory, so a shard of hundreds of MiB sat in the
# page cache until its fsync, and the disk was idle while the next shard was copied in (the sharded layout wrote
# at 0.62-0.99 of a plain synced write on an H200 host's disk, median 0.76).
WRITEBACK_BYTES = 32 << 20
_SYNC_FILE_RANGE_WRITE = 2  # start writing the range's dirty pages, without waiting for them


@functools.cache
def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """Linux's ``sync_file_range`` (which Python's ``os`` lacks), or None where there is none."""
    try:
        call = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return call


def _start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Have the disk start writing these bytes of the file. Advisory: the fsync that publishes the file is what
    makes it durable, so a file system that refuses it loses nothing."""
    call = _sync_file_range()
    if call is not None:
        call(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


def _write_all(fd: int, data: memoryview) -> int:
    """Write all of ``data`` (returns its size): one ``write`` may take less than it is given (Linux takes at
    most 2 GiB a call, and a capture's tensor may be larger), and a short write left unchecked is a silently
    truncated file."""
    done = 0
    while done < data.nbytes:
        done += os.write(fd, data[done:])
    return done


def _json_writer(record: dict[str, Any]) -> Callable[[Path], None]:
    return lambda tmp: tmp.write_text(json.dumps(record, indent=1) + "\n")


def _publish(path: Path, write: Callable[[Path], None]) -> None:
    """Write ``path`` through ``write(temp)`` so that it appears complete or not at all, and durably."""
    _publish_all([(path, write)])


def _publish_all(files: list[tuple[Path, Callable[[Path], None]]]) -> None:
    """Publish files of one directory: each written and fsynced under a temporary name, then all renamed,
    then the directory fsynced once (one directory sync per request instead of one per file)."""
    temps = [_temp_name(path) for path, _ in files]
    try:
        for tmp, (_, write) in zip(temps, files, strict=True):
            write(tmp)
            _fsync_path(tmp)
    except BaseException:
        for tmp in temps:
            tmp.unlink(missing_ok=True)
        raise
    _install([(tmp, path) for tmp, (path, _) in zip(temps, files, strict=True)], synced=True)


def _temp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")


def _install(moves: list[tuple[Path, Path]], synced: bool = False) -> None:
    """Rename written temporary files into place, fsynced first (unless ``synced``), then fsync their
    directories: each file appears complete or not at all, and durably. The temps are removed on failure."""
    try:
        if not synced:
            for tmp, _ in moves:
                _fsync_path(tmp)
        for tmp, path in moves:
            os.replace(tmp, path)
    except BaseException:
        for tmp, _ in moves:
            tmp.unlink(missing_ok=True)
        raise
    for directory in {path.parent for _, path in moves}:
        _fsync_path(directory)


def _append_lines(path: Path, records: list[dict[str, Any]]) -> None:
    text = "".join(json.dumps(r) + "\n" for r in records).encode()
    created = not path.exists()
    with open(path, "a+b") as f:
        # A crash mid-append leaves a partial last line: start a fresh one so it spoils no new record.
        if f.seek(0, os.SEEK_END):
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                text = b"\n" + text
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    if created:
        _fsync_path(path.parent)


def _remove(path: Path) -> None:
    if path.exists():
        path.unlink()
        _fsync_path(path.parent)


def _make_dirs(path: Path) -> None:
    """``mkdir -p`` that fsyncs the parent of each directory it creates, so the new entries survive a crash."""
    missing = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    for directory in reversed(missing):
        directory.mkdir(exist_ok=True)
        _fsync_path(directory.parent)


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- reading -------------------------------------------------------------------------------------------------------


def read_capture(
    root: str | os.PathLike, request_or_tag: str, layout: str | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Load one complete capture: ``({site: [positions, hidden] tensor}, metadata)``.

    ``request_or_tag`` is a base (as ``list_captures`` returns, or a tag) or a raw request id; ``layout`` limits
    the search to one layout, else all are tried. Raises ``FileNotFoundError`` if no complete capture matches.
    """
    if layout is not None and layout not in LAYOUTS:
        raise ValueError(f"layout: must be one of {', '.join(LAYOUTS)} (got {layout!r})")
    root = Path(root)
    stages = _stage_roots(root)
    found = [_read_one(stage, request_or_tag, layout) for stage in stages] if stages else [
        _read_one(root, request_or_tag, layout)]
    if any(part is None for part in found):
        raise FileNotFoundError(f"no complete capture {request_or_tag!r} under {root}")
    return _merge_stages(found)


def _read_one(root: Path, request_or_tag: str, layout: str | None):
    bases = [request_or_tag] if _is_safe_base(request_or_tag) else []
    bases += [b for b in [request_base(request_or_tag)] if b not in bases]
    for base, name in itertools.product(bases, [layout] if layout else LAYOUTS):
        found = _read_sharded(root, base) if name == "sharded" else _read_files(root, name, base)
        if found is not None:
            return found
    return None


def _stage_roots(root: Path) -> list[Path]:
    """The per-stage subtrees a pipeline-parallel engine wrote (none for a single-stage engine)."""
    return sorted(p for p in root.glob(f"{STAGE_PREFIX}*") if p.is_dir())


def _merge_stages(parts: list[tuple[dict[str, torch.Tensor], dict[str, Any]]]):
    """One capture from the stages' captures of the same request (each holds its own layers)."""
    return parts[0] if len(parts) == 1 else merge_stages(parts)


def list_captures(root: str | os.PathLike) -> list[str]:
    """The bases of every complete capture under ``root`` (of any layout), sorted; for a pipeline-parallel
    engine, those complete in every stage."""
    root = Path(root)
    stages = _stage_roots(root)
    if stages:
        return sorted(set.intersection(*(set(list_captures(stage)) for stage in stages)))
    found = set(_read_index(root))
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and not (here == root and d == SHARD_DIR)]
        for name in filenames:
            if name.endswith(".json") and not name.startswith("."):
                meta = _read_json(here / name)
                if meta is not None and _is_complete(root, here / name, meta):
                    found.add(meta["base"])
    return sorted(found)


def _is_complete(root: Path, sidecar: Path, meta: dict[str, Any]) -> bool:
    if meta.get("layout") not in ("packed", "per_file") or not isinstance(meta.get("base"), str):
        return False
    data_files, expected = _layout_files(root, meta["layout"], meta["base"], meta.get("sites", []))
    return expected == sidecar and all(p.is_file() for p in data_files)


def _read_files(root: Path, layout: str, base: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
    _, sidecar = _layout_files(root, layout, base, [])
    meta = _read_json(sidecar)
    if meta is None or not _is_complete(root, sidecar, meta) or meta["layout"] != layout:
        return None
    data_files, _ = _layout_files(root, layout, base, meta["sites"])
    if layout == "packed":
        loaded = load_file(data_files[0])
        return {site: loaded[site] for site in meta["sites"]}, meta
    return {site: load_file(path)[site] for site, path in zip(meta["sites"], data_files, strict=True)}, meta


def _read_sharded(root: Path, base: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
    records = _read_index(root).get(base)
    if records is None:
        return None
    parts = []
    for record in records:
        key = f"{base}/{record['capture']}.{record['part']}" if "capture" in record else base
        shard = _open_shard(root / SHARD_DIR / record["shard"])
        parts.append({site: shard.get_tensor(f"{key}/{site}") for site in record["sites"]})
    if len(parts) == 1:
        return parts[0], copy.deepcopy(records[0])
    # A capture in parts: its rows by position (a later part never repeats a position).
    positions = [p for record in records for p in record["positions"]]
    order = torch.tensor(sorted(range(len(positions)), key=positions.__getitem__), dtype=torch.long)
    tensors = {site: torch.cat([part[site] for part in parts]).index_select(0, order) for site in records[-1]["sites"]}
    meta = {key: copy.deepcopy(value) for key, value in records[-1].items() if key not in ("part", "final")}
    meta.update(positions=sorted(positions), shape=[len(positions), meta["shape"][1]], parts=len(records),
                shards=list(dict.fromkeys(record["shard"] for record in records)))
    return tensors, meta


def _open_shard(path: Path) -> Any:
    """A shard opened for reading, reused while the file is the same: its header names every tensor and
    request it holds, and parsing it again for each capture made reading a shard's N captures cost N times
    the header."""
    stat = path.stat()
    return _opened_shard(str(path), stat.st_ino, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _opened_shard(path: str, inode: int, mtime_ns: int) -> Any:
    return safe_open(path, framework="pt")


def _read_index(root: Path) -> dict[str, list[dict[str, Any]]]:
    """The sharded captures by base, each as its index lines (one, or its parts in order): the last complete
    capture of a base wins (an overwrite appends a newer one; a capture in parts is complete with its final
    part's line). Lines naming a shard that is not there are skipped. Shared between calls: not to be
    changed (callers copy what they hand out)."""
    index = root / SHARD_DIR / INDEX_NAME
    try:
        stat = index.stat()
    except FileNotFoundError:
        return {}
    # One listing rather than a stat per line; with the index's version, it keys what was built before.
    return _indexed_captures(str(index), stat.st_ino, stat.st_size, stat.st_mtime_ns,
                             frozenset(os.listdir(index.parent)))


@functools.lru_cache(maxsize=8)
def _indexed_captures(path: str, inode: int, size: int, mtime_ns: int,
                      shards: frozenset[str]) -> dict[str, list[dict[str, Any]]]:
    """``_read_index`` for one version of an index file (it is only ever appended to, so its size tells a new
    one) and one set of shard files: an export reads every capture of a root in turn, and parsing the index
    for each made reading N captures cost N times the whole index (2,000 small captures: 87 s)."""
    records: dict[str, list[dict[str, Any]]] = {}
    in_parts: dict[tuple[str, str], list[dict[str, Any]]] = {}  # (base, capture) -> its parts so far
    for line in Path(path).read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # the partial last line of an append cut short by a crash
        if record["shard"] not in shards:
            continue
        if "capture" not in record:
            records[record["base"]] = [record]
            continue
        parts = in_parts.setdefault((record["base"], record["capture"]), [])
        parts.append(record)
        if record["final"] and [r["part"] for r in parts] == list(range(len(parts))):
            records[record["base"]] = parts
    return records


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        record = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return record if isinstance(record, dict) else None


def _owned_or_absent(sidecar: Path, layout: str, base: str) -> bool:
    if not sidecar.exists():
        return True
    meta = _read_json(sidecar)
    return meta is not None and meta.get("layout") == layout and meta.get("base") == base
