"""The SAELens export without an engine: captures written by the real filesystem consumer (every layout) come
back from `datasets.load_from_disk` as SAELens's layout, row for row; the refusals; the CLI."""

import subprocess
import sys

import datasets
import pytest
import torch

from tests.conftest import VLLM_INTERP
from vllm_interp.capture.consumer import CaptureMeta, ConsumerContext, RequestCapture
from vllm_interp.capture.consumers.filesystem import FilesystemConsumer
from vllm_interp.capture.saelens_export import SaelensExportError, export_saelens

SITES = ["3.pre_attn", "3.post_block", "7.post_attn"]
COLUMNS = ["blocks.3.hook_resid_pre", "blocks.3.hook_resid_post", "blocks.7.hook_resid_mid"]
HIDDEN = 16
# Written out of order: the export follows the bases' sorted order (run-0, run-1, run-2), 5 + 7 + 4 rows.
RUNS = {"run-2": 4, "run-0": 5, "run-1": 7}


def make_capture(tag, rows, seed, sites=SITES, hidden=HIDDEN, dtype=torch.float32) -> RequestCapture:
    generator = torch.Generator().manual_seed(seed)
    positions = list(range(3, 3 + rows))
    meta = CaptureMeta(request_id=f"req-{tag}", tag=tag, model="tiny-model", prompt_len=3 + rows,
                       positions=positions, sites=list(sites), dtype=str(dtype).removeprefix("torch."))
    return RequestCapture(meta, {s: torch.randn(rows, hidden, generator=generator).to(dtype) for s in sites})


def write(root, captures, layout="packed") -> None:
    options = FilesystemConsumer.validate_engine_options({"root": str(root), "layout": layout})
    consumer = FilesystemConsumer(ConsumerContext("filesystem", options, "tiny-model", num_layers=8,
                                                  hidden_size=HIDDEN))
    for capture in captures:
        consumer.consume(capture)
    consumer.close()


def write_runs(root, layout="packed") -> dict[str, RequestCapture]:
    captures = {tag: make_capture(tag, rows, seed) for seed, (tag, rows) in enumerate(RUNS.items())}
    write(root, captures.values(), layout)
    return captures


def stream(captures: dict[str, RequestCapture], site: str) -> torch.Tensor:
    """One site's rows of every capture, in the export's order (sorted tags, then positions)."""
    return torch.cat([captures[tag].tensors[site] for tag in sorted(captures)])


def load(path):
    dataset = datasets.load_from_disk(str(path))
    dataset.set_format("torch")
    return dataset


def leftovers(directory) -> list:
    return [p.name for p in directory.iterdir() if p.name.startswith(".")]


# -- the layout and the rows ----------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["per_file", "packed", "sharded"])
def test_export_is_the_concatenated_rows_cut_into_sequences(tmp_path, layout):
    captures = write_runs(tmp_path / "captures", layout)
    done = export_saelens(tmp_path / "captures", tmp_path / "acts", context_size=3)

    assert (done.columns, done.context_size, done.d_in) == (COLUMNS, 3, HIDDEN)
    assert (done.sequences, done.captures, done.dropped) == (5, 3, 1)  # 16 rows: 5 sequences of 3, 1 left over
    dataset = load(tmp_path / "acts")
    assert dataset.column_names == COLUMNS  # no token_ids: captures carry none
    for column in COLUMNS:
        assert dataset.features[column] == datasets.Array2D(shape=(3, HIDDEN), dtype="float32")
    for site, column in zip(SITES, COLUMNS, strict=True):
        got = dataset[:][column]
        assert got.shape == (5, 3, HIDDEN) and got.dtype == torch.float32
        assert torch.equal(got.reshape(15, HIDDEN), stream(captures, site)[:15])
    assert leftovers(tmp_path) == []


def test_chosen_sites_in_either_spelling_from_captures_that_hold_more(tmp_path):
    captures = write_runs(tmp_path / "captures")
    done = export_saelens(tmp_path / "captures", tmp_path / "acts", context_size=4,
                          sites=["7.post_attn", "blocks.3.hook_resid_post", "3.post_block"])

    assert done.columns == ["blocks.3.hook_resid_post", "blocks.7.hook_resid_mid"]  # site order, once each
    dataset = load(tmp_path / "acts")
    assert dataset.column_names == done.columns and done.dropped == 0
    assert torch.equal(dataset[:]["blocks.7.hook_resid_mid"].reshape(16, HIDDEN), stream(captures, "7.post_attn"))


def test_transformer_lens_named_captures_join_the_others(tmp_path):
    plain = make_capture("a", 3, seed=0)
    lens = make_capture("b", 3, seed=1, sites=COLUMNS)
    write(tmp_path / "captures", [plain, lens])
    export_saelens(tmp_path / "captures", tmp_path / "acts", context_size=2)

    dataset = load(tmp_path / "acts")
    for site, column in zip(SITES, COLUMNS, strict=True):
        expected = torch.cat([plain.tensors[site], lens.tensors[column]])
        assert torch.equal(dataset[:][column].reshape(6, HIDDEN), expected)


def test_stored_dtype(tmp_path):
    captures = {"a": make_capture("a", 4, seed=0, dtype=torch.bfloat16)}
    write(tmp_path / "captures", captures.values())
    export_saelens(tmp_path / "captures", tmp_path / "wide", context_size=2)
    export_saelens(tmp_path / "captures", tmp_path / "half", context_size=2, sites=["3.pre_attn"], dtype="float16")

    wide, half = load(tmp_path / "wide"), load(tmp_path / "half")
    assert wide.features["blocks.3.hook_resid_pre"].dtype == "float32"  # Arrow has no bfloat16: widened exactly
    assert half.features["blocks.3.hook_resid_pre"].dtype == "float16"
    source = stream(captures, "3.pre_attn")
    assert torch.equal(wide[:]["blocks.3.hook_resid_pre"].reshape(4, HIDDEN), source.float())
    assert torch.equal(half[:]["blocks.3.hook_resid_pre"].reshape(4, HIDDEN), source.half())


# -- refusals -------------------------------------------------------------------------------------------------


def test_empty_or_missing_root(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / ".stray.tmp").write_text("")  # only complete captures count
    with pytest.raises(SaelensExportError, match="no complete captures under .*empty$"):
        export_saelens(tmp_path / "empty", tmp_path / "acts", context_size=2)
    with pytest.raises(SaelensExportError, match=r"no complete captures under .*nowhere \(no such directory\)"):
        export_saelens(tmp_path / "nowhere", tmp_path / "acts", context_size=2)
    assert not (tmp_path / "acts").exists()


@pytest.mark.parametrize("context_size", [0, -3, 2.5, True])
def test_bad_context_size(tmp_path, context_size):
    write_runs(tmp_path / "captures")
    with pytest.raises(SaelensExportError, match=r"context_size: must be an integer >= 1"):
        export_saelens(tmp_path / "captures", tmp_path / "acts", context_size=context_size)


@pytest.mark.parametrize(("sites", "message"), [
    (["5.post_block"], r"sites: unknown site '5.post_block': capture 'run-0' holds blocks.3.hook_resid_pre, "),
    (["blocks.3.hook_resid_post", "blocks.3.hook_attn_out"], r"sites: bad site name 'blocks.3.hook_attn_out'"),
    ([], r"sites: empty"),
])
def test_unknown_sites(tmp_path, sites, message):
    write_runs(tmp_path / "captures")
    with pytest.raises(SaelensExportError, match=message):
        export_saelens(tmp_path / "captures", tmp_path / "acts", context_size=2, sites=sites)


def test_bad_dtype(tmp_path):
    write_runs(tmp_path / "captures")
    with pytest.raises(SaelensExportError, match="dtype: must be one of float32, float16, float64"):
        export_saelens(tmp_path / "captures", tmp_path / "acts", context_size=2, dtype="bfloat16")


def test_captures_with_other_sites_are_refused_by_name(tmp_path):
    write(tmp_path / "captures", [make_capture("a", 3, seed=0), make_capture("b", 3, seed=1, sites=SITES[:2])])
    with pytest.raises(SaelensExportError, match=r"capture 'b' holds sites blocks.3.hook_resid_pre, "
                                                 r"blocks.3.hook_resid_post but 'a' holds .*--sites"):
        export_saelens(tmp_path / "captures", tmp_path / "acts", context_size=2)
    with pytest.raises(SaelensExportError, match=r"capture 'b' lacks the exported site\(s\) blocks.7.hook_resid_mid"):
        export_saelens(tmp_path / "captures", tmp_path / "acts", context_size=2, sites=["7.post_attn"])
    # What every capture holds exports.
    done = export_saelens(tmp_path / "captures", tmp_path / "acts", context_size=2, sites=["3.post_block"])
    assert done.sequences == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["acts", "captures"]  # the refusals left nothing


def test_captures_with_another_hidden_size_are_refused_by_name(tmp_path):
    write(tmp_path / "captures", [make_capture("a", 3, seed=0), make_capture("b", 3, seed=1, hidden=HIDDEN * 2)])
    with pytest.raises(SaelensExportError, match=r"capture 'b': blocks.3.hook_resid_pre has hidden size 32, not 16"):
        export_saelens(tmp_path / "captures", tmp_path / "acts", context_size=2)


def test_fewer_rows_than_one_sequence(tmp_path):
    write_runs(tmp_path / "captures")
    with pytest.raises(SaelensExportError, match="hold 16 rows, fewer than one sequence of context_size 17"):
        export_saelens(tmp_path / "captures", tmp_path / "acts", context_size=17)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["captures"]


def test_out_must_be_absent_or_empty(tmp_path):
    write_runs(tmp_path / "captures")
    (tmp_path / "acts").mkdir()
    export_saelens(tmp_path / "captures", tmp_path / "acts", context_size=16)  # an empty directory is replaced
    with pytest.raises(FileExistsError, match="acts exists and is not an empty directory"):
        export_saelens(tmp_path / "captures", tmp_path / "acts", context_size=16)
    assert len(load(tmp_path / "acts")) == 1


def test_without_datasets_the_message_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ImportError, match=r"pip install 'vllm-interp\[saelens\]'"):
        export_saelens(tmp_path, tmp_path / "acts", context_size=2)


# -- the command ----------------------------------------------------------------------------------------------


def test_cli(tmp_path):
    captures = write_runs(tmp_path / "captures", "sharded")
    command = [VLLM_INTERP, "export-saelens", "--root", str(tmp_path / "captures"), "--out", str(tmp_path / "acts"),
               "--context-size", "5", "--sites", "blocks.3.hook_resid_post"]
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
    assert (f"wrote 3 sequences of 5 x {HIDDEN} (blocks.3.hook_resid_post) from 3 captures to {tmp_path / 'acts'}; "
            "1 trailing rows did not fill a sequence") in done.stdout
    got = load(tmp_path / "acts")[:]["blocks.3.hook_resid_post"]
    assert torch.equal(got.reshape(15, HIDDEN), stream(captures, "3.post_block")[:15])

    refused = subprocess.run(command, capture_output=True, text=True)
    assert refused.returncode == 1 and "error: " in refused.stderr and "Traceback" not in refused.stderr
