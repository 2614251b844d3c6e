"""The filesystem capture consumer without an engine: layouts round-trip, collisions, unsafe tags, options,
I/O failures, and a writer killed at each step of its publish leaving exactly that step's files."""

import errno
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from vllm_interp.capture.consumer import CaptureMeta, ConsumerContext, EngineFacts, RequestCapture
from vllm_interp.capture.consumers import filesystem
from vllm_interp.capture.consumers.filesystem import FilesystemConsumer, list_captures, read_capture
from vllm_interp.capture.spec import CaptureSpecError, validate_capture_spec

SITES = ["3.pre_attn", "3.post_block", "7.post_attn"]
HIDDEN = 16
POSITIONS = [2, 3, 4, 5, 6]
REPO = Path(__file__).resolve().parents[2]


def make_capture(request_id="req-1", tag=None, seed=0, **options) -> RequestCapture:
    generator = torch.Generator().manual_seed(seed)
    meta = CaptureMeta(
        request_id=request_id,
        tag=tag,
        model="tiny-model",
        prompt_len=6,
        positions=POSITIONS,
        sites=SITES,
        dtype="float32",
        options=options,
    )
    return RequestCapture(meta, {site: torch.randn(len(POSITIONS), HIDDEN, generator=generator) for site in SITES})


def make_consumer(root: Path, **options: str) -> FilesystemConsumer:
    validated = FilesystemConsumer.validate_engine_options({"root": str(root), **options})
    return FilesystemConsumer(ConsumerContext("filesystem", validated, "tiny-model", num_layers=8, hidden_size=HIDDEN))


def visible_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))


def temp_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob(".*.tmp"))


def assert_same_tensors(got: dict[str, torch.Tensor], capture: RequestCapture) -> None:
    assert list(got) == SITES
    for site in SITES:
        torch.testing.assert_close(got[site], capture.tensors[site], rtol=0, atol=0)


def assert_sidecar(meta: dict, capture: RequestCapture, layout: str, base: str) -> None:
    assert meta["request_id"] == capture.meta.request_id
    assert meta["tag"] == capture.meta.tag
    assert meta["layout"] == layout and meta["base"] == base
    assert meta["sites"] == SITES and meta["layers"] == [3, 7]
    assert meta["hooks"] == ["pre_attn", "post_attn", "post_block"]  # hook order, whatever the layers
    assert meta["positions"] == POSITIONS and meta["prompt_len"] == 6
    assert meta["dtype"] == "float32" and meta["model"] == "tiny-model"
    assert meta["shape"] == [len(POSITIONS), HIDDEN]


# -- round trips ---------------------------------------------------------------------------------------------------


def test_packed_round_trip(tmp_path):
    capture = make_capture(tag="exp/run1")
    result = make_consumer(tmp_path).consume(capture)

    data, sidecar = tmp_path / "exp/run1.safetensors", tmp_path / "exp/run1.json"
    assert result == {
        "layout": "packed",
        "base": "exp/run1",
        "path": str(data),
        "files": [str(data), str(sidecar)],
        "bytes": data.stat().st_size + sidecar.stat().st_size,
    }
    assert visible_files(tmp_path) == sorted([data, sidecar]) and not temp_files(tmp_path)
    tensors, meta = read_capture(tmp_path, "exp/run1")
    assert_same_tensors(tensors, capture)
    assert_sidecar(meta, capture, "packed", "exp/run1")
    assert json.loads(sidecar.read_text()) == meta
    with safe_open(data, framework="pt") as f:
        assert sorted(f.keys()) == sorted(SITES)
        assert_same_tensors({site: f.get_tensor(site) for site in SITES}, capture)
        assert json.loads(f.metadata()["vllm_interp"]) == meta
    assert list_captures(tmp_path) == ["exp/run1"]


def test_per_file_round_trip(tmp_path):
    capture = make_capture(tag="run2")
    result = make_consumer(tmp_path, layout="per_file").consume(capture)

    directory = tmp_path / "run2"
    site_files = [directory / f"{site}.safetensors" for site in SITES]
    assert result["layout"] == "per_file" and result["path"] == str(directory)
    assert result["files"] == [str(p) for p in [*site_files, directory / "meta.json"]]
    tensors, meta = read_capture(tmp_path, "run2", layout="per_file")
    assert_same_tensors(tensors, capture)
    assert_sidecar(meta, capture, "per_file", "run2")
    assert json.loads((directory / "meta.json").read_text()) == meta
    for site, path in zip(SITES, site_files, strict=True):
        with safe_open(path, framework="pt") as f:
            assert f.keys() == [site]
            assert list(f.get_tensor(site).shape) == [len(POSITIONS), HIDDEN]
            torch.testing.assert_close(f.get_tensor(site), capture.tensors[site], rtol=0, atol=0)
            assert json.loads(f.metadata()["vllm_interp"]) == meta
    assert list_captures(tmp_path) == ["run2"]


def test_sharded_round_trip_is_published_at_close(tmp_path):
    consumer = make_consumer(tmp_path, layout="sharded")
    captures = [make_capture(request_id=f"r{i}", seed=i) for i in range(2)]
    results = [consumer.consume(c) for c in captures]

    shard = tmp_path / "shards" / "shard-00000.safetensors"
    assert [r["pending"] for r in results] == [True, True] and {r["shard"] for r in results} == {shard.name}
    assert not shard.exists() and list_captures(tmp_path) == []
    consumer.close()

    index = [json.loads(line) for line in (tmp_path / "shards" / "index.jsonl").read_text().splitlines()]
    assert [(r["base"], r["shard"]) for r in index] == [("r0", shard.name), ("r1", shard.name)]
    assert list_captures(tmp_path) == ["r0", "r1"]
    with safe_open(shard, framework="pt") as f:
        assert sorted(f.keys()) == sorted(f"r{i}/{site}" for i in range(2) for site in SITES)
        stored = json.loads(f.metadata()["vllm_interp"])
        assert [r["base"] for r in stored["requests"]] == ["r0", "r1"]
        for i, capture in enumerate(captures):
            assert_same_tensors({site: f.get_tensor(f"r{i}/{site}") for site in SITES}, capture)
    for i, capture in enumerate(captures):
        tensors, meta = read_capture(tmp_path, f"r{i}")
        assert_same_tensors(tensors, capture)
        assert_sidecar(meta, capture, "sharded", f"r{i}")
        assert meta == index[i]


def test_a_shard_goes_to_the_disk_as_it_is_written(tmp_path, monkeypatch):
    """The writer has the disk start on each chunk of a shard as it is written (not all at the fsync), and the
    shard reads back as written."""
    monkeypatch.setattr(filesystem, "WRITEBACK_BYTES", 2 * len(POSITIONS) * HIDDEN * 4)  # two tensors' bytes
    started, start = [], filesystem._start_writeback
    monkeypatch.setattr(filesystem, "_start_writeback",
                        lambda fd, offset, nbytes: started.append((offset, nbytes)) or start(fd, offset, nbytes))
    consumer = make_consumer(tmp_path, layout="sharded")
    captures = [make_capture(request_id=f"r{i}", seed=i) for i in range(3)]
    for capture in captures:
        consumer.consume(capture)
    consumer.close()
    size = (tmp_path / "shards" / "shard-00000.safetensors").stat().st_size
    chunk = filesystem.WRITEBACK_BYTES
    assert len(started) >= 4 and [offset for offset, _ in started] == [0] + [o + n for o, n in started[:-1]]
    assert all(n >= chunk for _, n in started) and size - sum(n for _, n in started) < chunk
    for i, capture in enumerate(captures):
        assert_same_tensors(read_capture(tmp_path, f"r{i}")[0], capture)


def test_reading_every_sharded_capture_parses_the_index_once_per_version(tmp_path):
    """An export reads each capture of a root in turn: the index (and a shard's header) is parsed once, not
    once per capture, and lines appended later are seen; what a read returns is the caller's own."""
    consumer = make_consumer(tmp_path, layout="sharded")
    for i in range(6):
        consumer.consume(make_capture(request_id=f"r{i}", seed=i))
    consumer.close()
    filesystem._indexed_captures.cache_clear()
    filesystem._opened_shard.cache_clear()
    for base in list_captures(tmp_path):
        _, meta = read_capture(tmp_path, base)
        meta["sites"].append("spoiled")  # the caller's copy: the next read must not see it
    assert filesystem._indexed_captures.cache_info().misses == 1
    assert filesystem._opened_shard.cache_info().misses == 1  # the one shard all six share
    assert read_capture(tmp_path, "r0")[1]["sites"] == SITES
    consumer = make_consumer(tmp_path, layout="sharded")
    consumer.consume(make_capture(request_id="late", seed=9))
    consumer.close()  # appends the index: a new version of it
    assert "late" in list_captures(tmp_path)
    assert filesystem._indexed_captures.cache_info().misses == 2
    (tmp_path / "shards" / "shard-00001.safetensors").unlink()  # a shard gone: its captures are not listed
    assert "late" not in list_captures(tmp_path) and "r0" in list_captures(tmp_path)
    with pytest.raises(FileNotFoundError):
        read_capture(tmp_path, "late")


def in_parts(capture: RequestCapture, bounds: list[int]) -> list[RequestCapture]:
    """``capture`` as the worker hands on a request in parts: its positions cut at ``bounds``."""
    edges = [0, *bounds, len(capture.meta.positions)]
    parts = []
    for k, (start, stop) in enumerate(zip(edges, edges[1:], strict=False)):
        meta = replace(capture.meta, positions=capture.meta.positions[start:stop], part=k, final=k == len(edges) - 2)
        parts.append(RequestCapture(meta, {site: t[start:stop] for site, t in capture.tensors.items()}))
    return parts


def test_sharded_takes_a_request_in_parts_and_reads_it_back_whole(tmp_path):
    """Parts of a running request go to the buffer (and shards) as they come, between other requests; the
    capture is listed, and read back joined by position, once its final part's index line is appended; a newer
    capture of the same tag in parts replaces it; one whose final part never came is not listed."""
    consumer = make_consumer(tmp_path, layout="sharded", part_mb="1")
    assert FilesystemConsumer.part_bytes(consumer.context.options) == 1 << 20
    assert FilesystemConsumer.part_bytes({**consumer.context.options, "layout": "packed"}) == 0
    assert FilesystemConsumer.part_bytes({**consumer.context.options, "part_mb": 0}) == 0  # a request's own say
    consumer.shard_bytes = make_capture().nbytes  # a shard about every request: parts span shards
    whole = make_capture(request_id="a", tag="doc")
    first, second, last = in_parts(whole, [2, 3])
    results = [consumer.consume(first), consumer.consume(make_capture(request_id="b", seed=1)),
               consumer.consume(second)]
    consumer.wait_written()
    assert list_captures(tmp_path) == ["b"]  # not "doc": its final part has not come
    results.append(consumer.consume(last))
    merged = FilesystemConsumer.merge_parts([results[0], results[2], results[3]])
    assert merged["parts"] == 3 and merged["bytes"] == whole.nbytes and merged["base"] == "doc"
    consumer.close()
    assert list_captures(tmp_path) == ["b", "doc"]
    tensors, meta = read_capture(tmp_path, "doc")
    assert_same_tensors(tensors, whole)
    assert meta["positions"] == POSITIONS and meta["shape"] == [len(POSITIONS), HIDDEN] and meta["parts"] == 3
    assert len(meta["shards"]) > 1

    consumer = make_consumer(tmp_path, layout="sharded", part_mb="1", on_collision="overwrite")
    newer = make_capture(request_id="c", tag="doc", seed=5)
    for part in in_parts(newer, [1]):
        consumer.consume(part)
    unfinished, _ = in_parts(make_capture(request_id="d", tag="cut", seed=6), [4])
    consumer.consume(unfinished)
    with pytest.raises(ValueError, match="its first part was not stored"):
        consumer.consume(in_parts(make_capture(request_id="e"), [1])[1])
    consumer.close()
    assert list_captures(tmp_path) == ["b", "doc"]
    assert_same_tensors(read_capture(tmp_path, "doc")[0], newer)


def capture_in_memory_of_its_own(request_id: str, seed: int) -> tuple[RequestCapture, np.ndarray]:
    """``make_capture``'s rows as views of one array (as a block holds a request's rows), and the array."""
    given = make_capture(request_id=request_id, seed=seed)
    memory = np.empty(given.nbytes // 4, dtype=np.float32)
    whole, tensors = torch.from_numpy(memory), {}
    for i, (site, tensor) in enumerate(given.tensors.items()):
        tensors[site] = whole[i * tensor.numel(): (i + 1) * tensor.numel()].view(tensor.shape)
        tensors[site].copy_(tensor)
    return RequestCapture(given.meta, tensors), memory


def views(memories: list[np.ndarray]) -> list[int]:
    """How many arrays or tensors view each of ``memories`` (beyond the list and getrefcount's argument)."""
    return [sys.getrefcount(memories[i]) - 2 for i in range(len(memories))]


def test_sharded_holds_the_rows_it_buffers_until_their_shard_is_published(tmp_path):
    """No copy: a shard's rows are the tensors ``consume`` was given, let go of once the shard is published (a
    consumer in its own process keeps their shared block lent meanwhile: test_isolation)."""
    consumer = make_consumer(tmp_path, layout="sharded")
    consumer.shard_bytes = make_capture().nbytes  # every request fills a shard
    memories = []
    for i in range(3):
        given, memory = capture_in_memory_of_its_own(f"r{i}", seed=i)
        memories.append(memory)
        consumer.consume(given)
        del given, memory
    # A rollover waits for the shard two before it: r0's shard is published and let go of.
    assert views(memories)[0] == 0 and views(memories)[2] > 0
    assert consumer._writing[-1][1]["r2"].tensors[SITES[0]].data_ptr() == memories[2].ctypes.data
    consumer.wait_written()
    assert views(memories) == [0, 0, 0]
    consumer.close()
    for i in range(3):
        assert_same_tensors(read_capture(tmp_path, f"r{i}")[0], make_capture(request_id=f"r{i}", seed=i))


def test_sharded_rolls_over_before_a_shard_would_pass_its_limit(tmp_path):
    consumer = make_consumer(tmp_path, layout="sharded")
    one = make_capture().nbytes
    consumer.shard_bytes = 2 * one + one // 2
    results = [consumer.consume(make_capture(request_id=f"r{i}", seed=i)) for i in range(3)]

    assert [(r["shard"], r["pending"]) for r in results] == [
        ("shard-00000.safetensors", True),
        ("shard-00000.safetensors", True),
        ("shard-00001.safetensors", True),
    ]
    consumer.wait_written()  # the full shard went to the writer thread
    assert list_captures(tmp_path) == ["r0", "r1"]
    consumer.shard_bytes = one // 2
    big = consumer.consume(make_capture(request_id="big"))  # fills a shard alone: r2's shard goes first
    assert big["shard"] == "shard-00002.safetensors"
    consumer.wait_written()
    assert list_captures(tmp_path) == ["big", "r0", "r1", "r2"]


def test_a_shard_is_written_while_the_one_before_it_is_synced_and_the_next_one_fills(tmp_path, monkeypatch):
    consumer = make_consumer(tmp_path, layout="sharded")
    consumer.shard_bytes = make_capture().nbytes  # every request fills a shard
    release, publishing = threading.Event(), threading.Event()
    real = filesystem._install

    def slow_install(moves, synced=False):
        publishing.set()
        assert release.wait(30)
        real(moves, synced)

    monkeypatch.setattr(filesystem, "_install", slow_install)
    consumer.consume(make_capture(request_id="r0"))
    assert publishing.wait(30)
    consumer.consume(make_capture(request_id="r1", seed=1))  # r0's shard is being published: r1's is written
    deadline = time.monotonic() + 30
    while len(temp_files(tmp_path)) < 2:
        assert time.monotonic() < deadline, "the second shard's data was not written while the first was synced"
        time.sleep(0.01)
    taken = threading.Thread(target=consumer.consume, args=(make_capture(request_id="r2", seed=2),))
    taken.start()
    time.sleep(0.2)
    # r2 waits for r0's shard (two shards with the writers), not for its own.
    assert taken.is_alive() and list_captures(tmp_path) == []
    release.set()
    taken.join(30)
    consumer.close()
    assert list_captures(tmp_path) == ["r0", "r1", "r2"] and temp_files(tmp_path) == []


def test_a_failed_background_shard_fails_the_request_that_finds_it_and_is_retried(tmp_path, monkeypatch):
    """The shard after a failed one is not published either; both come back, in order, for the next shard."""
    consumer = make_consumer(tmp_path, layout="sharded")
    consumer.shard_bytes = make_capture().nbytes
    real_fsync = os.fsync

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    assert consumer.consume(make_capture(request_id="r0"))["pending"]
    assert consumer.consume(make_capture(request_id="r1", seed=1))["pending"]  # a second shard: no wait yet
    with pytest.raises(OSError, match="No space left"):
        consumer.consume(make_capture(request_id="r2", seed=2))
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert temp_files(tmp_path) == [] and list_captures(tmp_path) == []
    consumer.consume(make_capture(request_id="r3", seed=3))
    consumer.close()
    index = [json.loads(line) for line in (tmp_path / "shards" / "index.jsonl").read_text().splitlines()]
    assert [record["base"] for record in index] == ["r0", "r1", "r3"]
    for i in (0, 1, 3):
        assert_same_tensors(read_capture(tmp_path, f"r{i}")[0], make_capture(request_id=f"r{i}", seed=i))


@pytest.mark.parametrize("layout", ["packed", "per_file", "sharded"])
def test_a_capture_without_rows_round_trips(tmp_path, layout):
    meta = CaptureMeta("empty", None, "tiny-model", 6, [], SITES, "float32")
    consumer = make_consumer(tmp_path, layout=layout)
    consumer.consume(RequestCapture(meta, {site: torch.empty(0, HIDDEN) for site in SITES}))
    consumer.close()
    tensors, stored = read_capture(tmp_path, "empty")
    assert [list(t.shape) for t in tensors.values()] == [[0, HIDDEN]] * len(SITES)
    assert stored["shape"] == [0, HIDDEN]


def test_request_options_override_the_engine_layout(tmp_path):
    make_consumer(tmp_path).consume(make_capture(tag="a", layout="per_file"))
    assert (tmp_path / "a" / "meta.json").exists() and not (tmp_path / "a.json").exists()


def test_request_ids_become_safe_file_names(tmp_path):
    capture = make_capture(request_id="cmpl-7:0/x y")
    result = make_consumer(tmp_path).consume(capture)
    assert result["base"] == "cmpl-7_0_x_y"
    assert_same_tensors(read_capture(tmp_path, "cmpl-7:0/x y")[0], capture)


# -- collisions ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["packed", "per_file", "sharded"])
def test_collision_error_keeps_the_first_capture(tmp_path, layout):
    consumer = make_consumer(tmp_path, layout=layout)
    first = make_capture(tag="t", seed=1)
    consumer.consume(first)
    with pytest.raises(FileExistsError, match="'t' already exists"):
        consumer.consume(make_capture(tag="t", seed=2))
    consumer.close()
    assert_same_tensors(read_capture(tmp_path, "t")[0], first)


@pytest.mark.parametrize("layout", ["packed", "per_file", "sharded"])
def test_collision_overwrite_replaces(tmp_path, layout):
    consumer = make_consumer(tmp_path, layout=layout, on_collision="overwrite")
    consumer.consume(make_capture(tag="t", seed=1))
    consumer.close()
    second = make_capture(tag="t", seed=2)
    consumer.consume(second)
    consumer.close()
    assert_same_tensors(read_capture(tmp_path, "t")[0], second)
    assert list_captures(tmp_path) == ["t"]


@pytest.mark.parametrize("layout", ["packed", "per_file", "sharded"])
def test_collision_suffix_picks_the_first_free_name(tmp_path, layout):
    consumer = make_consumer(tmp_path, layout=layout, on_collision="suffix")
    captures = [make_capture(tag="t", seed=i) for i in range(3)]
    assert [consumer.consume(c)["base"] for c in captures] == ["t", "t-1", "t-2"]
    consumer.close()
    for base, capture in zip(["t", "t-1", "t-2"], captures, strict=True):
        assert_same_tensors(read_capture(tmp_path, base)[0], capture)


def test_overwrite_never_replaces_another_layouts_capture(tmp_path):
    make_consumer(tmp_path).consume(make_capture(tag="t"))
    with pytest.raises(FileExistsError, match="same layout"):
        make_consumer(tmp_path, layout="per_file", on_collision="overwrite").consume(make_capture(tag="t"))
    consumer = make_consumer(tmp_path, layout="per_file")
    consumer.consume(make_capture(tag="d"))
    with pytest.raises(ValueError, match="inside the per_file capture"):
        consumer.consume(make_capture(tag="d/3.pre_attn", layout="packed"))
    assert list_captures(tmp_path) == ["d", "t"]


# -- paths ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tag", ["../evil", "a/../../evil", "/abs/evil", "a//b", ".hidden", "shards/x", "link/evil"])
def test_unsafe_tags_are_rejected_and_nothing_is_written(tmp_path, tag):
    root, outside = tmp_path / "root", tmp_path / "outside"
    outside.mkdir()
    consumer = make_consumer(root)
    (root / "link").symlink_to(outside)
    with pytest.raises(ValueError, match="^tag: "):
        consumer.consume(make_capture(tag=tag))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outside", "root"]
    assert list(outside.iterdir()) == [] and visible_files(root) == []


def test_a_traversing_request_id_stays_under_root(tmp_path):
    root = tmp_path / "root"
    result = make_consumer(root).consume(make_capture(request_id="../../x"))
    assert Path(result["path"]).parent == root
    assert [p.name for p in tmp_path.iterdir()] == ["root"]
    assert_same_tensors(read_capture(root, "../../x")[0], make_capture())


# -- options -------------------------------------------------------------------------------------------------------


def test_engine_options_are_converted_with_defaults(tmp_path):
    assert FilesystemConsumer.validate_engine_options({"root": str(tmp_path), "shard_mb": "64"}) == {
        "root": str(tmp_path),
        "layout": "packed",
        "on_collision": "error",
        "shard_mb": 64,
        "part_mb": 8,
    }


@pytest.mark.parametrize(
    ("options", "option"),
    [
        ({}, "root"),
        ({"root": ""}, "root"),
        ({"root": "TMP/file"}, "root"),
        ({"root": "TMP", "layout": "zip"}, "layout"),
        ({"root": "TMP", "on_collision": "ignore"}, "on_collision"),
        ({"root": "TMP", "shard_mb": "0"}, "shard_mb"),
        ({"root": "TMP", "shard_mb": "big"}, "shard_mb"),
        ({"root": "TMP", "part_mb": "-1"}, "part_mb"),
        ({"root": "TMP", "compress": "yes"}, "compress"),
    ],
)
def test_engine_option_errors_name_the_option(tmp_path, options, option):
    (tmp_path / "file").write_text("")
    options = {key: value.replace("TMP", str(tmp_path)) for key, value in options.items()}
    with pytest.raises(ValueError, match=f"^{option}: "):
        FilesystemConsumer.validate_engine_options(options)


@pytest.mark.parametrize(
    ("options", "option"),
    [({"layout": "zip"}, "layout"), ({"on_collision": 1}, "on_collision"), ({"shard_mb": 3}, "shard_mb"),
     ({"part_mb": -1}, "part_mb"), ({"part_mb": "8"}, "part_mb"), ({"part_mb": True}, "part_mb")],
)
def test_request_option_errors_name_the_option(options, option):
    with pytest.raises(ValueError, match=f"^{option}: "):
        FilesystemConsumer.validate_options(options, EngineFacts(8))
    spec = {"filesystem": {"hooks": {"post_block": [1]}, **options}}
    with pytest.raises(CaptureSpecError, match=f"^capture.filesystem.{option}: "):
        validate_capture_spec(spec, engine=EngineFacts(8), consumers={"filesystem": FilesystemConsumer})


def test_request_options_pass_validation():
    options = {"layout": "sharded", "on_collision": "suffix"}
    assert FilesystemConsumer.validate_options(options, EngineFacts(8)) == options
    raw = {"filesystem": {"hooks": {"post_block": [1]}, **options}}
    spec = validate_capture_spec(raw, engine=EngineFacts(8), consumers={"filesystem": FilesystemConsumer})
    assert spec["filesystem"].options == options


# -- failures ------------------------------------------------------------------------------------------------------


def test_readers_ignore_temp_files_and_data_without_a_sidecar(tmp_path):
    make_consumer(tmp_path).consume(make_capture(tag="done"))
    (tmp_path / "done.safetensors").rename(tmp_path / "orphan.safetensors")
    (tmp_path / ".x.safetensors.1234.tmp").write_bytes(b"partial")
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "index.jsonl").write_text('{"base": "cut", "shard": "shard-00000.safetens')
    assert list_captures(tmp_path) == []
    with pytest.raises(FileNotFoundError):
        read_capture(tmp_path, "done")


@pytest.mark.parametrize("layout", ["packed", "per_file"])
def test_disk_full_propagates_and_leaves_no_temp_file(tmp_path, monkeypatch, layout):
    consumer = make_consumer(tmp_path, layout=layout)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError) as caught:
        consumer.consume(make_capture(tag="t"))
    assert caught.value.errno == errno.ENOSPC
    assert temp_files(tmp_path) == [] and visible_files(tmp_path) == []


def test_a_write_cut_short_leaves_no_temp_file(tmp_path, monkeypatch):
    def half_written(path):
        Path(path).write_bytes(b"\0" * 1000)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(filesystem, "_safetensors_writer", lambda tensors, meta: half_written)
    with pytest.raises(OSError, match="No space left"):
        make_consumer(tmp_path).consume(make_capture(tag="t"))
    assert temp_files(tmp_path) == [] and visible_files(tmp_path) == []


@pytest.mark.parametrize("layout", ["packed", "sharded"])
def test_a_short_write_is_finished_rather_than_leaving_a_truncated_file(tmp_path, monkeypatch, layout):
    """The kernel may take less than a write asks (Linux: at most 2 GiB a call): the rest is written too."""
    real_write = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: real_write(fd, data[:50]))  # at most 50 bytes a call
    consumer = make_consumer(tmp_path, layout=layout)
    capture = make_capture(tag="t")
    consumer.consume(capture)
    consumer.close()
    assert_same_tensors(read_capture(tmp_path, "t")[0], capture)


def test_a_failed_shard_publish_keeps_the_buffer_for_a_retry(tmp_path, monkeypatch):
    consumer = make_consumer(tmp_path, layout="sharded")
    capture = make_capture()
    consumer.consume(capture)
    real_fsync = os.fsync

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError):
        consumer.close()
    assert temp_files(tmp_path) == [] and list_captures(tmp_path) == []
    monkeypatch.setattr(os, "fsync", real_fsync)
    consumer.close()
    assert_same_tensors(read_capture(tmp_path, "req-1")[0], capture)


# -- a writer killed at each step of its publish -------------------------------------------------------------------

# Each layout's publish, as the os calls FilesystemConsumer makes (paths relative to the root, a temp file's random
# part as "*"), each with what a writer killed just before that call leaves under the root and whether that is a
# complete capture. "returned" is a kill after consume() and close() returned. Derived from _write_files,
# _write_sharded/_flush, _publish_all, _append_lines and _make_dirs: a change of order fails the trace check.
_SITE_FILES = [f"one/{site}.safetensors" for site in SITES]
_SITE_TEMPS = [f"one/.{site}.safetensors.*.tmp" for site in SITES]
PUBLISH_STEPS: dict[str, tuple[str, list[tuple[list[str], list[str], bool]]]] = {
    "packed": ("sweep/one", [
        (["mkdir", "sweep"], [], False),
        (["fsync", "."], ["sweep/"], False),
        (["fsync", "sweep/.one.safetensors.*.tmp"], ["sweep/", "sweep/.one.safetensors.*.tmp"], False),
        (["replace", "sweep/.one.safetensors.*.tmp", "sweep/one.safetensors"],
         ["sweep/", "sweep/.one.safetensors.*.tmp"], False),
        (["fsync", "sweep"], ["sweep/", "sweep/one.safetensors"], False),
        (["fsync", "sweep/.one.json.*.tmp"], ["sweep/", "sweep/one.safetensors", "sweep/.one.json.*.tmp"], False),
        (["replace", "sweep/.one.json.*.tmp", "sweep/one.json"],
         ["sweep/", "sweep/one.safetensors", "sweep/.one.json.*.tmp"], False),
        (["fsync", "sweep"], ["sweep/", "sweep/one.safetensors", "sweep/one.json"], True),
        (["returned"], ["sweep/", "sweep/one.safetensors", "sweep/one.json"], True),
    ]),
    # Every site file is written and synced under its temp name, then all are renamed, then one directory sync.
    "per_file": ("one", [
        (["mkdir", "one"], [], False),
        (["fsync", "."], ["one/"], False),
        *[(["fsync", temp], ["one/", *_SITE_TEMPS[: i + 1]], False) for i, temp in enumerate(_SITE_TEMPS)],
        *[(["replace", temp, data], ["one/", *_SITE_FILES[:i], *_SITE_TEMPS[i:]], False)
          for i, (temp, data) in enumerate(zip(_SITE_TEMPS, _SITE_FILES, strict=True))],
        (["fsync", "one"], ["one/", *_SITE_FILES], False),
        (["fsync", "one/.meta.json.*.tmp"], ["one/", *_SITE_FILES, "one/.meta.json.*.tmp"], False),
        (["replace", "one/.meta.json.*.tmp", "one/meta.json"], ["one/", *_SITE_FILES, "one/.meta.json.*.tmp"], False),
        (["fsync", "one"], ["one/", *_SITE_FILES, "one/meta.json"], True),
        (["returned"], ["one/", *_SITE_FILES, "one/meta.json"], True),
    ]),
    # consume() only buffers a sharded request; close() publishes the shard, then appends its index line.
    "sharded": ("one", [
        (["mkdir", "shards"], [], False),
        (["fsync", "."], ["shards/"], False),
        (["fsync", "shards/.shard-00000.safetensors.*.tmp"], ["shards/", "shards/.shard-00000.safetensors.*.tmp"],
         False),
        (["replace", "shards/.shard-00000.safetensors.*.tmp", "shards/shard-00000.safetensors"],
         ["shards/", "shards/.shard-00000.safetensors.*.tmp"], False),
        (["fsync", "shards"], ["shards/", "shards/shard-00000.safetensors"], False),
        # The line is written before its fsync, and a killed process's writes stay in the page cache: complete.
        (["fsync", "shards/index.jsonl"], ["shards/", "shards/shard-00000.safetensors", "shards/index.jsonl"], True),
        (["fsync", "shards"], ["shards/", "shards/shard-00000.safetensors", "shards/index.jsonl"], True),
        (["returned"], ["shards/", "shards/shard-00000.safetensors", "shards/index.jsonl"], True),
    ]),
}
_TEMP_PART = re.compile(r"\.[0-9a-f]{8}\.tmp$")


def normalized(path: str) -> str:
    """A path with a temp file's random part as "*", so that runs compare equal."""
    return _TEMP_PART.sub(".*.tmp", path)


def tree(root: Path) -> list[str]:
    """Every entry under root, relative, directories with a trailing "/"."""
    return sorted(normalized(p.relative_to(root).as_posix()) + ("/" if p.is_dir() else "") for p in root.rglob("*"))


# Imports once, then forks a writer per request line (a fresh interpreter per kill would spend ~2 s importing
# torch). The writer logs each os call of its publish to its trace file before making it, and at call number
# stop_at writes "frozen" and waits for the test's SIGKILL, so the kill lands exactly before that call.
FORKING_WRITER = textwrap.dedent(
    """
    import json, os, signal, sys, traceback
    from pathlib import Path
    from tests.capture.test_filesystem import make_capture, make_consumer, normalized

    def write(root, layout, tag, stop_at, trace_path):
        trace = open(trace_path, "w", buffering=1)
        calls = 0

        def relative(path):
            return normalized(os.path.relpath(os.fspath(path), root))

        def step(*call):
            nonlocal calls
            trace.write(json.dumps(call) + "\\n")
            if calls == stop_at:
                trace.write(json.dumps("frozen") + "\\n")
                signal.pause()
            calls += 1

        def hook(name, describe):
            real = getattr(os, name)

            def logged(*args, **kwargs):
                step(name, *describe(*args))
                return real(*args, **kwargs)

            setattr(os, name, logged)

        consumer = make_consumer(Path(root), layout=layout)
        hook("fsync", lambda fd: [relative(os.readlink(f"/proc/self/fd/{fd}"))])
        for name in ("replace", "rename"):
            hook(name, lambda src, dst: [relative(src), relative(dst)])
        for name in ("mkdir", "unlink", "rmdir"):
            hook(name, lambda path, *_: [relative(path)])
        consumer.consume(make_capture(tag=tag))
        consumer.close()
        step("returned")

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the killed writers
    for line in sys.stdin:
        pid = os.fork()
        if pid == 0:
            try:
                write(**json.loads(line))
            except BaseException:
                traceback.print_exc()
            os._exit(0)
        print(pid, flush=True)
    """
)


@pytest.fixture(scope="module")
def forking_writer():
    server = subprocess.Popen([sys.executable, "-c", FORKING_WRITER], cwd=REPO, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    yield server
    server.stdin.close()
    server.wait(30)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def kill_writer_at(server: subprocess.Popen, root: Path, layout: str, tag: str, stop_at: int, trace: Path) -> list:
    """Fork a writer of ``make_capture(tag=tag)`` under ``root``, SIGKILL it just before its os call number
    ``stop_at``, and return its trace: the calls it logged, then "frozen"."""
    request = {"root": str(root), "layout": layout, "tag": tag, "stop_at": stop_at, "trace_path": str(trace)}
    server.stdin.write(json.dumps(request) + "\n")
    server.stdin.flush()
    line = server.stdout.readline()
    assert line, "the forking writer died (its traceback is on stderr)"
    pid = int(line)
    try:
        deadline = time.monotonic() + 30
        while not (trace.exists() and trace.read_text().endswith('"frozen"\n')):
            assert _alive(pid), f"the writer ended before call {stop_at}; it made {trace.read_text()}"
            assert time.monotonic() < deadline, f"the writer never reached call {stop_at}"
            time.sleep(0.002)
    finally:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
    while _alive(pid):
        time.sleep(0.002)
    return [json.loads(line) for line in trace.read_text().splitlines()]


def assert_published_data_is_whole(root: Path, capture: RequestCapture) -> None:
    """Every visible data file holds all its tensors, whole: data is renamed into place only once written."""
    for path in root.rglob("*.safetensors"):
        if path.name.startswith("."):
            continue
        with safe_open(path, framework="pt") as f:
            names = list(f.keys())
            assert names, path
            for name in names:
                got = f.get_tensor(name)
                torch.testing.assert_close(got, capture.tensors[name.rsplit("/", 1)[-1]], rtol=0, atol=0)


KILL_POINTS = [(layout, step) for layout, (_, steps) in PUBLISH_STEPS.items() for step in range(len(steps))]
KILL_POINT_IDS = [f"{layout}-{step}-before-{PUBLISH_STEPS[layout][1][step][0][0]}" for layout, step in KILL_POINTS]


@pytest.mark.parametrize(("layout", "step"), KILL_POINTS, ids=KILL_POINT_IDS)
def test_a_writer_killed_at_each_step_of_its_publish_leaves_exactly_that_steps_files(
    forking_writer, tmp_path, layout, step
):
    tag, steps = PUBLISH_STEPS[layout]
    root = (tmp_path / "root").resolve()
    root.mkdir()
    trace = kill_writer_at(forking_writer, root, layout, tag, step, tmp_path / "trace.jsonl")

    assert trace == [*(call for call, _, _ in steps[: step + 1]), "frozen"]
    _, on_disk, complete = steps[step]
    assert tree(root) == sorted(on_disk)
    written = make_capture(tag=tag)
    assert_published_data_is_whole(root, written)
    if complete:
        assert list_captures(root) == [tag]
        tensors, meta = read_capture(root, tag)
        assert_same_tensors(tensors, written)
        assert_sidecar(meta, written, layout, tag)
    else:
        assert list_captures(root) == []
        with pytest.raises(FileNotFoundError):
            read_capture(root, tag)

    # Whatever the killed writer left, a new one (told to overwrite) publishes the tag over it.
    fresh = make_capture(tag=tag, seed=1)
    consumer = make_consumer(root, layout=layout, on_collision="overwrite")
    consumer.consume(fresh)
    consumer.close()
    assert list_captures(root) == [tag]
    assert_same_tensors(read_capture(root, tag)[0], fresh)


@pytest.mark.parametrize("layout", ["packed", "per_file", "sharded"])
def test_pipeline_stages_write_their_own_layers_and_read_back_as_one(tmp_path, layout):
    whole = make_capture(tag="pp/run")
    stage_sites = [["3.pre_attn", "3.post_block"], ["7.post_attn"]]
    validated = FilesystemConsumer.validate_engine_options({"root": str(tmp_path), "layout": layout})
    for rank, sites in enumerate(stage_sites):
        context = ConsumerContext("filesystem", validated, "tiny-model", num_layers=8, hidden_size=HIDDEN,
                                  pipeline_rank=rank, pipeline_size=2)
        consumer = FilesystemConsumer(context)
        meta = CaptureMeta(**{**whole.meta.__dict__, "sites": sites})
        consumer.consume(RequestCapture(meta, {site: whole.tensors[site] for site in sites}))
        consumer.close()
    tensors, meta = read_capture(tmp_path, "pp/run")
    assert_same_tensors(tensors, whole)
    assert meta["sites"] == SITES and meta["layers"] == [3, 7]
    assert list_captures(tmp_path) == ["pp/run"]
