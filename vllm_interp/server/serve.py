"""`vllm-interp serve`: vLLM's `serve` subcommand with the vllm-interp flags added.

vLLM has no hook for adding CLI flags, so this builds vLLM's own serve parser, adds a group of ours,
folds our flags into ``worker_cls`` and ``additional_config`` and hands the namespace back to vLLM.
"""

import argparse
import atexit
import os
import shutil
import tempfile

from vllm_interp.config import (
    DEFAULT_MAX_CAPTURE_BYTES_PER_REQUEST,
    DEFAULT_MAX_INTERP_BODY_BYTES,
    DEFAULT_MAX_NAMED_VECTORS,
    DEFAULT_MAX_PATCH_ROWS,
    DEFAULT_MAX_STEERING_CONFIGS,
    DEFAULT_MAX_STEERING_SITES_PER_REQUEST,
    DEFAULT_MAX_SWEEP_CELLS,
    DEFAULT_PATCH_SOURCE_BYTES,
    OVERLOAD_POLICIES,
    FrontendLimits,
    InterpConfig,
)
from vllm_interp.default_model import resolve_model
from vllm_interp.engine.args import check_model_architecture, interp_engine_args
from vllm_interp.engine.versions import adapter
from vllm_interp.server.auth import API_KEY_ENV
from vllm_interp.server.plugin import PLUGIN_NAME
from vllm_interp.server.shared_steering import ENV as SHARED_STEERING_ENV
from vllm_interp.steering.files import parse_named_file


def add_serve_parser(subparsers: argparse._SubParsersAction) -> None:
    command = adapter("serve").serve_subcommand()
    parser = command.subparser_init(subparsers)
    parser.usage = "vllm-interp serve [model_tag] [vllm serve options] [vllm-interp options]"
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
    group = parser.add_argument_group("vllm-interp", "Interpretability features (all off by default).")
    group.add_argument("--enable-steering", action="store_true",
                       help="Residual steering (/v1/steering/*, steering fields on completions).")
    group.add_argument("--max-steering-configs", type=int, default=DEFAULT_MAX_STEERING_CONFIGS,
                       help="Distinct per-request steering configs resident at once; more wait for a slot.")
    group.add_argument("--steering-vectors", action="append", default=[], metavar="NAME=PATH",
                       help="Register named steering vectors at start-up (.safetensors or .json; repeatable).")
    group.add_argument("--steering-api-key", action="append", default=[], metavar="KEY",
                       help="Key required by every mutating endpoint of ours: /v1/steering/set, clear, "
                       "vectors/register, vectors/unregister, vectors/contrastive with a name, DELETE "
                       f"/v1/patch_sources/ID (repeatable; or ${API_KEY_ENV}, comma-separated).")
    group.add_argument("--max-steering-sites-per-request", type=int, default=DEFAULT_MAX_STEERING_SITES_PER_REQUEST,
                       help="Site vectors one request may steer with, all tiers and its named vectors together "
                       "(also bounds a named entry and the global vectors).")
    group.add_argument("--max-named-vectors", type=int, default=DEFAULT_MAX_NAMED_VECTORS,
                       help="Named steering entries the server keeps.")
    group.add_argument("--enable-patching", action="store_true",
                       help="Activation patching (the patch field on completions, /v1/patch_sources, the patch_source "
                       "capture consumer).")
    group.add_argument("--max-patch-rows", type=int, default=DEFAULT_MAX_PATCH_ROWS,
                       help="Patched rows one engine step holds (a request with more patches is refused).")
    group.add_argument("--max-graph-capture-rows", type=int, default=None,
                       help="Rows one engine step may capture and still replay CUDA graphs (each site holds a buffer "
                       "of this many rows); steps capturing more run eagerly. Default: vLLM's largest CUDA graph size "
                       "(max_cudagraph_capture_size), so no step vLLM would replay runs eagerly to capture. 0: "
                       "capturing steps always run eagerly.")
    group.add_argument("--max-sweep-cells", type=int, default=DEFAULT_MAX_SWEEP_CELLS,
                       help="Cells one /v1/patch_sweep request may ask for (hooks x layers x positions).")
    group.add_argument("--patch-source-bytes", type=int, default=DEFAULT_PATCH_SOURCE_BYTES,
                       help="Worker memory for patch source runs; least recently used runs are evicted beyond it.")
    group.add_argument(
        "--capture-consumers",
        action="append",
        default=[],
        metavar="NAME[:KEY=VAL,...]",
        help="Enable a capture consumer with options (repeatable); every consumer also takes queue_mb and "
        "spill_dir. Built in: inline, filesystem (root=DIR,layout=packed|per_file|sharded,...), logging.",
    )
    group.add_argument("--capture-global", default="", metavar="JSON",
                       help='A capture spec applied to every request, e.g. \'{"logging": {"hooks": "all"}}\'.')
    group.add_argument("--sae", action="append", default=[], metavar="NAME=DIR",
                       help="Load a sparse autoencoder saved by SAELens (cfg.json + sae_weights.safetensors; "
                       "repeatable): steering entries {sae, feature, scale} and the sae_features consumer use it.")
    group.add_argument("--capture-overload-policy", choices=OVERLOAD_POLICIES, default="block",
                       help="What a consumer whose queue is full does with more rows: wait (block), drop them "
                       "(reported in the request's result) or park them on disk (spill).")
    group.add_argument("--engine-switch-interval-ms", type=float, default=0.0,
                       help="The engine processes' Python switch interval (sys.setswitchinterval), in ms: how long "
                       "the forward thread may wait to take the interpreter lock back from a capture consumer's "
                       "thread after a torch or CUDA call. 0: Python's default (5 ms).")
    group.add_argument("--max-capture-bytes-per-request", type=int, default=DEFAULT_MAX_CAPTURE_BYTES_PER_REQUEST,
                       help="Worst-case bytes of the rows one request's capture may select (positions x sites x "
                       "hidden x 4, all consumers together); larger specs are refused with a 400.")
    group.add_argument("--max-interp-body-bytes", type=int, default=DEFAULT_MAX_INTERP_BODY_BYTES,
                       help="Bytes of a request body carrying vllm-interp fields (steering, capture, patch), or sent "
                       "to a vllm-interp route; larger bodies get a 413.")


def serve(command, args: argparse.Namespace) -> None:
    limits = FrontendLimits.from_args(args)
    for flag in args.steering_vectors:
        parse_named_file(flag)
    if len(args.steering_vectors) > limits.max_named_vectors:
        raise ValueError(f"--steering-vectors: {len(args.steering_vectors)} named entries, more than "
                         f"--max-named-vectors {limits.max_named_vectors}")
    config = InterpConfig(
        enable_steering=args.enable_steering,
        max_steering_configs=args.max_steering_configs,
        enable_patching=args.enable_patching,
        max_patch_rows=args.max_patch_rows,
        patch_source_bytes=args.patch_source_bytes,
        max_graph_capture_rows=args.max_graph_capture_rows,
        capture_consumers=tuple(args.capture_consumers),
        capture_global=args.capture_global,
        capture_overload_policy=args.capture_overload_policy,
        engine_switch_interval_ms=args.engine_switch_interval_ms,
        saes=tuple(args.sae),
    )
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
    # vLLM pickles the namespace into each API-server process it spawns (--api-server-count N): what only our
    # dispatch uses (a closure, the terminal stream) would not pickle, and those processes do not dispatch.
    for ours in ("dispatch_function", "terminal"):
        vars(args).pop(ours, None)
    command.cmd(args)


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
