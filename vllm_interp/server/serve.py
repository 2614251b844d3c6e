"""`vllm-interp serve`: vLLM's `serve` subcommand with the vllm-interp flags added.

vLLM has no hook for adding CLI flags, so this builds vLLM's own serve parser, adds our group
(``serve_flags.py``, which also checks them before vLLM is imported), folds our flags into ``worker_cls`` and
``additional_config`` and hands the namespace back to vLLM.
"""

import argparse
import atexit
import os
import shutil
import sys
import tempfile

from vllm_interp.default_model import resolve_model
from vllm_interp.engine.args import check_model_architecture, interp_engine_args
from vllm_interp.engine.versions import adapter
from vllm_interp.models.registry import UnsupportedArchitecture
from vllm_interp.server.plugin import PLUGIN_NAME
from vllm_interp.server.serve_flags import USAGE, add_interp_flags, interp_settings
from vllm_interp.server.shared_steering import ENV as SHARED_STEERING_ENV


def add_serve_parser(subparsers: argparse._SubParsersAction) -> None:
    command = adapter("serve").serve_subcommand()
    parser = command.subparser_init(subparsers)
    parser.usage = USAGE
    parser.description = (
        "vLLM's OpenAI-compatible server with vllm-interp in the forward pass. Takes every `vllm serve` "
        "option; the model defaults to SmolLM2-135M-Instruct (built on first use)."
    )
    parser.epilog = (
        "Our options:              vllm-interp serve --help=vllm-interp\n"
        "All options:              vllm-interp serve --help=all\n"
        "A section:                vllm-interp serve --help=ModelConfig    (case-insensitive)"
    )
    # No model given means the default model (prepared on first use), not vLLM's default.
    parser.set_defaults(model=None, dispatch_function=lambda args: serve(command, args))
    adapter("serve").defer_shutdown_timeout(parser)
    add_interp_flags(parser)


def serve(command, args: argparse.Namespace) -> None:
    try:
        _prepare(command, args)
    except (ValueError, UnsupportedArchitecture) as exc:  # what the flags ask for cannot start: no traceback
        sys.exit(f"vllm-interp serve: error: {exc}")
    # vLLM pickles the namespace into each API-server process it spawns (--api-server-count N): what only our
    # dispatch uses (a closure, the terminal stream) would not pickle, and those processes do not dispatch.
    for ours in ("dispatch_function", "terminal"):
        vars(args).pop(ours, None)
    command.cmd(args)


def _prepare(command, args: argparse.Namespace) -> None:
    """Check the flags on the namespace vLLM parsed and fold ours into vLLM's engine arguments."""
    config, _ = interp_settings(args)
    if config.hooks_needed:
        _refuse_several_engines(args)
    _share_steering_state()
    args.model = resolve_model(args.model_tag or args.model)
    args.model_tag = None
    if config.hooks_needed:
        check_model_architecture(args.model, model_impl=args.model_impl, trust_remote_code=args.trust_remote_code)
    args.worker_cls, args.additional_config = interp_engine_args(
        config, worker_cls=args.worker_cls, additional_config=args.additional_config
    )
    adapter("serve").choose_shutdown_timeout(args, capturing=bool(config.capture_consumers))
    adapter("serve").allow_plugins("vllm_interp", PLUGIN_NAME)
    command.validate(args)


def _refuse_several_engines(args: argparse.Namespace) -> None:
    """Several API servers in front of one engine share their steering state (server/shared_steering.py);
    several engines would each need the global vectors and answer for their own requests' results, which
    vllm-interp does not do."""
    engines = adapter("serve").engine_count(args)
    if engines > 1:
        raise ValueError(
            f"vllm-interp features need one engine behind the API servers, but these flags start {engines} "
            "(data parallelism): each would need the global steering vectors and answer for its own requests' "
            "capture results. Use tensor or pipeline parallelism, or one vllm-interp server per replica "
            "(--api-server-count N is fine)"
        )


def _share_steering_state() -> None:
    """A private directory for this server's API servers' shared steering state, named to them in the
    environment (which vLLM's API-server processes inherit), removed when this process exits. Always a new
    one: an inherited name would join another server's state."""
    directory = tempfile.mkdtemp(prefix="vllm-interp-steering-")
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    os.environ[SHARED_STEERING_ENV] = directory
