import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from vllm_interp.capture.consumer import CaptureMeta, ConsumerContext, RequestCapture
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
    assert list_captures(tmp_path) == ["r0", "r1"]
    consumer.shard_bytes = one // 2
    big = consumer.consume(make_capture(request_id="big"))
    assert (big["shard"], big["pending"]) == ("shard-00002.safetensors", False)
    assert list_captures(tmp_path) == ["big", "r0", "r1", "r2"]


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
    [({"layout": "zip"}, "layout"), ({"on_collision": 1}, "on_collision"), ({"shard_mb": 3}, "shard_mb")],
)
def test_request_option_errors_name_the_option(options, option):
    with pytest.raises(ValueError, match=f"^{option}: "):
        FilesystemConsumer.validate_options(options)
    spec = {"filesystem": {"hooks": {"post_block": [1]}, **options}}
    with pytest.raises(CaptureSpecError, match=f"^capture.filesystem.{option}: "):
        validate_capture_spec(spec, num_layers=8, consumers={"filesystem": FilesystemConsumer})


def test_request_options_pass_validation():
    options = {"layout": "sharded", "on_collision": "suffix"}
    assert FilesystemConsumer.validate_options(options) == options
    raw = {"filesystem": {"hooks": {"post_block": [1]}, **options}}
    spec = validate_capture_spec(raw, num_layers=8, consumers={"filesystem": FilesystemConsumer})
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
    def half_written(tensors, path, metadata):
        Path(path).write_bytes(b"\0" * 1000)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(filesystem, "save_file", half_written)
    with pytest.raises(OSError, match="No space left"):
        make_consumer(tmp_path).consume(make_capture(tag="t"))
    assert temp_files(tmp_path) == [] and visible_files(tmp_path) == []


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


KILLED_WRITER = textwrap.dedent(
    """
    import os, sys, time
    import torch
    from vllm_interp.capture.consumer import CaptureMeta, ConsumerContext, RequestCapture
    from vllm_interp.capture.consumers.filesystem import FilesystemConsumer

    real_fsync = os.fsync

    def slow_fsync(fd):
        # Holds the writer before any rename, so the kill always lands mid-write however fast the disk is.
        time.sleep(60)
        real_fsync(fd)

    os.fsync = slow_fsync
    sites = [f"{layer}.post_block" for layer in range(50)]
    meta = CaptureMeta("big", "big", "m", 1000, list(range(1000)), sites, "float32")
    capture = RequestCapture(meta, {site: torch.ones(1000, 1024) for site in sites})  # 200 MiB
    options = FilesystemConsumer.validate_engine_options({"root": sys.argv[1]})
    FilesystemConsumer(ConsumerContext("filesystem", options, "m", 50, 1024)).consume(capture)
    """
)


def test_a_writer_killed_mid_write_leaves_nothing_that_looks_complete(tmp_path):
    writer = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(tmp_path)], cwd=REPO)
    try:
        deadline = time.monotonic() + 30
        while not (temp_files(tmp_path) or visible_files(tmp_path)):
            assert writer.poll() is None, "the writer exited before it began writing"
            assert time.monotonic() < deadline, "the writer never began writing"
            time.sleep(0.005)
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait()

    assert temp_files(tmp_path) and list_captures(tmp_path) == []
    for path in visible_files(tmp_path):
        if path.suffix == ".safetensors":
            assert path.with_suffix(".json").exists()
            with safe_open(path, framework="pt"):
                pass
    small = make_capture(tag="big")
    make_consumer(tmp_path).consume(small)
    assert list_captures(tmp_path) == ["big"]


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
