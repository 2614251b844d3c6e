"""The ``serve`` subcommand's internals: vLLM's parser and runner, its CLI environment, how many engines its
API servers front for these flags, and which plugins ``VLLM_PLUGINS`` lets load."""

import argparse
import os
from typing import Any

from vllm_interp.engine.touchpoints import Touchpoint, VllmInternalsMismatch, check_touchpoints

# vLLM's engine gives a worker this many seconds (default 5) to exit once told to stop, then SIGTERM, then
# SIGKILL 4 s later.
WORKER_SHUTDOWN_ENV = "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS"

TOUCHPOINTS = (
    Touchpoint("vllm.entrypoints.cli.serve:ServeSubcommand.subparser_init", "call",
               "`vllm-interp serve` is vLLM's own serve parser with our flags added", params=("subparsers",)),
    Touchpoint("vllm.entrypoints.cli.serve:ServeSubcommand.validate", "call", "vLLM's checks of the parsed flags",
               params=("args",)),
    Touchpoint("vllm.entrypoints.cli.serve:ServeSubcommand.cmd", "call", "vLLM starts the server", params=("args",)),
    Touchpoint("vllm.entrypoints.serve.utils.api_utils:cli_env_setup", "call",
               "the environment `vllm serve` sets up before parsing"),
    Touchpoint("env:VLLM_PLUGINS", "env", "endpoint plugins load only when named there"),
    Touchpoint("vllm.utils.argparse_utils:FlexibleArgumentParser", "call",
               "vLLM's serve parser needs vLLM's parser class (config files, --help=SECTION)"),
    Touchpoint("vllm.engine.arg_utils:EngineArgs.shutdown_timeout", "read",
               "with capture on, a stopped server waits for consumers to publish instead of vLLM's default kill"),
    Touchpoint(f"env:{WORKER_SHUTDOWN_ENV}", "env",
               "how long the engine waits for a worker to exit (its consumers publishing) before killing it"),
)
# How long a server with capture consumers, stopped by a signal, lets the engine drain its requests and close
# its consumers (which publish what they buffer, such as a sharded layout's last shard) before vLLM kills it.
# vLLM's own default, 0, aborts requests and kills the engine's whole process tree at once.
CAPTURE_SHUTDOWN_TIMEOUT_S = 30
# Flags whose meaning engine_count reads (vLLM's data-parallel launch rules).
DATA_PARALLEL_FLAGS = ("headless", "data_parallel_size", "data_parallel_size_local",
                    "data_parallel_rank", "data_parallel_start_rank", "data_parallel_external_lb",
                    "data_parallel_hybrid_lb", "data_parallel_multi_port_external_lb")


def serve_subcommand() -> Any:
    check_touchpoints(TOUCHPOINTS)
    from vllm.entrypoints.cli.serve import ServeSubcommand

    return ServeSubcommand()


def argument_parser(**kwargs: Any) -> argparse.ArgumentParser:
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return FlexibleArgumentParser(**kwargs)


def cli_env_setup() -> None:
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup as setup

    setup()


def engine_count(args: argparse.Namespace) -> int:
    """How many engines (data-parallel ranks) the API servers that ``vllm serve`` starts for these flags
    front: every rank under vLLM's internal load balancing, the local ones in hybrid mode, one per local rank
    under --data-parallel-multi-port-external-lb (a server each, all started by this process), and one for an
    externally balanced rank or a headless one."""
    if missing := [flag for flag in DATA_PARALLEL_FLAGS if not hasattr(args, flag)]:
        raise VllmInternalsMismatch(f"vllm serve no longer has --{missing[0].replace('_', '-')}: vllm-interp "
                                    "cannot tell how many engines these flags start")
    if args.data_parallel_multi_port_external_lb:
        return args.data_parallel_size_local or 1
    if args.headless or args.data_parallel_external_lb or args.data_parallel_rank is not None:
        return 1
    if args.data_parallel_hybrid_lb or args.data_parallel_start_rank is not None:
        return args.data_parallel_size_local or 1
    return args.data_parallel_size


def defer_shutdown_timeout(parser: argparse.ArgumentParser) -> None:
    """Parse ``--shutdown-timeout`` as None when not given, so ``choose_shutdown_timeout`` can tell."""
    parser.set_defaults(shutdown_timeout=None)


def choose_shutdown_timeout(args: argparse.Namespace, capturing: bool) -> None:
    """The user's ``--shutdown-timeout`` if given; else ``CAPTURE_SHUTDOWN_TIMEOUT_S`` with capture consumers
    (vLLM's abort would kill them before they publish what they buffer), vLLM's 0 without. With consumers, a
    worker also gets that long to exit (unless ``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS`` is set): it closes its
    consumers on the way out, and a busy host or a large last shard can take longer than vLLM's 5 s, after which
    the worker is killed and a consumer process finishes publishing after the server has exited."""
    if args.shutdown_timeout is None:
        args.shutdown_timeout = CAPTURE_SHUTDOWN_TIMEOUT_S if capturing else 0
    if capturing and args.shutdown_timeout > 0:
        os.environ.setdefault(WORKER_SHUTDOWN_ENV, str(args.shutdown_timeout))


def allow_plugins(*names: str) -> None:
    """vLLM loads endpoint plugins only when VLLM_PLUGINS names them, and the same list filters general
    plugins: keep every general plugin that would load anyway and add ``names``."""
    from importlib.metadata import entry_points

    current = os.environ.get("VLLM_PLUGINS")
    loaded = current.split(",") if current else [ep.name for ep in entry_points(group="vllm.general_plugins")]
    os.environ["VLLM_PLUGINS"] = ",".join(dict.fromkeys([*loaded, *names]))
