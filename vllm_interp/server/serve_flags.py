"""vllm-interp's own `serve` flags: declared once, and checked before vLLM is imported.

Building vLLM's serve parser imports vLLM (10-30 s on two cores), so ``vllm-interp serve`` first parses the
command line for our flags alone and checks them (``check_before_vllm``): a typo in a consumer name, a
limit or a named file is answered in a second or two. ``serve.py`` adds the same flags to vLLM's parser and
checks them again (``interp_settings``) on the namespace vLLM parsed, which also holds what a ``--config``
file set.
"""

import argparse
from collections.abc import Sequence

from vllm_interp.capture.plugins import configure_consumers
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
from vllm_interp.server.auth import API_KEY_ENV
from vllm_interp.steering.files import parse_named_file

USAGE = "vllm-interp serve [model_tag] [vllm serve options] [vllm-interp options]"


def add_interp_flags(parser: argparse.ArgumentParser) -> None:
    """Our flags, as the ``vllm-interp`` group of ``parser``."""
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


def interp_settings(args: argparse.Namespace) -> tuple[InterpConfig, FrontendLimits]:
    """The engine config and request limits our flags set; a ``ValueError`` naming the flag for any bad one (the
    consumers and their options included)."""
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
    configure_consumers(config.consumers)
    return config, limits


def check_before_vllm(argv: Sequence[str]) -> None:
    """Check our flags on ``serve``'s command line (its arguments after ``serve``) before vLLM's parser is built;
    exits with argparse's usage error for a bad one. Read as vLLM's parser reads them: ``--a_b`` is ``--a-b``,
    and a unique prefix of a flag is the flag (no vLLM serve option is a prefix of ours, which
    ``tests/server/test_serve_flags.py`` checks). Skipped for help, which vLLM's parser answers, and where a
    ``--config`` file may set our flags too (vLLM's parser reads it; the later check sees them)."""
    if any(arg in ("-h", "--config") or arg.startswith(("--help", "--config=")) for arg in argv):
        return
    parser = argparse.ArgumentParser(prog="vllm-interp serve", usage=USAGE, add_help=False)
    add_interp_flags(parser)
    args, _ = parser.parse_known_args([_dashed(arg) for arg in argv])
    try:
        interp_settings(args)
    except ValueError as exc:
        parser.error(str(exc))


def _dashed(arg: str) -> str:
    """``--a_b[=v]`` as ``--a-b[=v]``, as vLLM's parser spells an option before parsing."""
    if not arg.startswith("--"):
        return arg
    key, sep, value = arg.partition("=")
    return key.replace("_", "-") + sep + value
