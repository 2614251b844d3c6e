"""Our `serve` flags checked before vLLM is imported, and again on the namespace vLLM's parser makes."""

import argparse
import subprocess
import sys

import pytest

from vllm_interp.server.serve_flags import add_interp_flags, check_before_vllm, interp_settings

REFUSE_EARLY = """
import contextlib, io, sys
from vllm_interp.cli import main
for argv in (["--sae", "nodir"], ["--capture_consumers", "nosuch"], ["--max-named-vec", "0"]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            main(["serve", *argv])
        except SystemExit as exc:
            print(exc.code, err.getvalue().strip().splitlines()[-1])
print("imported vllm:", "vllm" in sys.modules)
"""


def test_a_bad_flag_of_ours_is_answered_before_vllm_is_imported():
    # Building vLLM's serve parser imports vLLM (10-30 s here); a typo in our flags needs none of it.
    out = subprocess.run([sys.executable, "-c", REFUSE_EARLY], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines() == [
        "2 vllm-interp serve: error: --sae 'nodir': expected NAME=DIR",
        # vLLM's spelling with underscores, and a unique prefix, read as vLLM's parser reads them
        "2 vllm-interp serve: error: --capture-consumers: unknown consumer 'nosuch'; installed "
        "(vllm_interp.capture_consumers): filesystem, inline, logging, patch_source, sae_features",
        "2 vllm-interp serve: error: --max-named-vectors must be a positive integer, got 0",
        "imported vllm: False",
    ]


def test_the_early_check_leaves_what_it_cannot_see_to_the_later_one(tmp_path):
    # Consumers set in a --config file: only vLLM's parser reads it, so the early check must not refuse the
    # global capture spec for want of them.
    config = tmp_path / "serve.yaml"
    config.write_text("capture-consumers: [inline]\n")
    check_before_vllm(["--config", str(config), "--capture-global", '{"inline": {}}'])
    check_before_vllm(["--help=vllm-interp", "--sae", "nodir"])  # vLLM's parser answers help
    check_before_vllm(["some-model", "--port", "8001", "--enable-steering"])  # vLLM's options pass untouched
    with pytest.raises(SystemExit):
        check_before_vllm(["--capture-global", '{"inline": {}}'])


def test_vllms_namespace_is_checked_again():
    from vllm_interp.cli import build_parser

    args = build_parser().parse_args(["serve", "some-model", "--capture-consumers", "nosuch"])
    with pytest.raises(ValueError, match="unknown consumer 'nosuch'"):
        interp_settings(args)
    config, limits = interp_settings(build_parser().parse_args(
        ["serve", "some-model", "--capture-consumers", "inline", "--max-sweep-cells", "9"]))
    assert config.consumers == ("inline",) and limits.max_sweep_cells == 9


def test_no_vllm_serve_option_is_a_prefix_of_ours():
    # The early parser knows our flags only: an option vLLM's parser takes exactly but which begins one of
    # ours would be read there as our flag, abbreviated.
    from vllm_interp.cli import build_parser

    ours = argparse.ArgumentParser(add_help=False)
    add_interp_flags(ours)
    our_options = {option for action in ours._actions for option in action.option_strings}
    serve = next(action for action in build_parser()._actions if isinstance(action, argparse._SubParsersAction))
    vllms = {option for action in serve.choices["serve"]._actions for option in action.option_strings} - our_options
    assert our_options and len(vllms) > 100
    assert not [(theirs, mine) for theirs in vllms for mine in our_options if mine.startswith(theirs)]
