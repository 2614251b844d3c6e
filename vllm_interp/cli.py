"""The `vllm-interp` command: serve, trace, demo, models, export-saelens."""

import argparse
import sys
from typing import TextIO

SERVE_HELP = ("vLLM's OpenAI-compatible server with vllm-interp in the forward pass: every `vllm serve` option "
              "and ours (vllm-interp serve --help).")


def _models(args: argparse.Namespace) -> None:
    from vllm_interp.models.registry import supported_architectures

    if args.models_command == "prepare":
        from vllm_interp.default_model import prepare_default_model

        print(prepare_default_model(force=args.force))
    else:
        print("\n".join(supported_architectures()))


def _demo(args: argparse.Namespace) -> None:
    from vllm_interp.demo import run_demo

    run_demo(model=args.model, prompt=args.prompt, max_tokens=args.max_tokens, out=args.terminal)


def _export_saelens(args: argparse.Namespace) -> None:
    from vllm_interp.capture.saelens_export import SaelensExportError, export_saelens

    try:
        done = export_saelens(args.root, args.out, context_size=args.context_size, sites=args.sites, dtype=args.dtype)
    except (SaelensExportError, FileExistsError, ImportError) as exc:
        sys.exit(f"error: {exc}")
    print(f"wrote {done.sequences} sequences of {done.context_size} x {done.d_in} ({', '.join(done.columns)}) from "
          f"{done.captures} captures to {done.path}; {done.dropped} trailing rows did not fill a sequence")


ENGINE_COMMANDS = ("serve", "demo")  # commands that start vLLM here: its version is checked, its CLI environment set


def build_parser(serve_options: bool = True) -> argparse.ArgumentParser:
    """Every command's parser. ``serve``'s options are vLLM's own parser and ours, which imports vLLM (10-20 s on
    two cores): without ``serve_options`` (any other command, or none: ``--help``) ``serve`` is listed but not
    built, so that ``trace``, ``models``, ``export-saelens`` and the top-level help answer at once."""
    from vllm_interp.capture.saelens_export import DTYPES
    from vllm_interp.client.trace import add_trace_parser

    about = {"prog": "vllm-interp", "description": "Residual-stream steering, capture and patching inside vLLM."}
    if serve_options:
        from vllm_interp.engine.versions import adapter
        from vllm_interp.server.serve import add_serve_parser

        parser = adapter("serve").argument_parser(**about)
    else:
        parser = argparse.ArgumentParser(**about)
    sub = parser.add_subparsers(dest="subparser", required=True)
    if serve_options:
        add_serve_parser(sub)
    else:
        sub.add_parser("serve", help=SERVE_HELP)
    add_trace_parser(sub)

    demo = sub.add_parser("demo", help="Run the main job on the default model: a completion plus a read-out.")
    demo.add_argument("--model", default=None, help="Model path (default: SmolLM2-135M-Instruct).")
    demo.add_argument("--prompt", default="The capital of France is")
    demo.add_argument("--max-tokens", type=int, default=12)
    demo.add_argument("--verbose", action="store_true",
                      help="Show vLLM's own output here instead of in the demo's log file.")
    demo.set_defaults(dispatch_function=_demo)

    models = sub.add_parser("models", help="The default model and the supported architectures.")
    models_sub = models.add_subparsers(dest="models_command", required=True)
    prepare = models_sub.add_parser("prepare", help="Build SmolLM2-135M-Instruct (fp32) into the cache.")
    prepare.add_argument("--force", action="store_true", help="Rebuild even if present.")
    models_sub.add_parser("supported", help="List the architectures vllm-interp can hook.")
    models.set_defaults(dispatch_function=_models)

    export = sub.add_parser("export-saelens", help="Write filesystem captures as a SAELens cached-activation dataset.")
    export.add_argument("--root", required=True, help="The filesystem consumer's root.")
    export.add_argument("--out", required=True, help="The dataset directory to write (absent or empty).")
    export.add_argument("--context-size", type=int, required=True, help="Rows per dataset row (SAELens context_size).")
    export.add_argument("--sites", nargs="+", default=None,
                        help="Sites to export, e.g. blocks.3.hook_resid_post or 3.post_block (default: all captured).")
    export.add_argument("--dtype", choices=DTYPES, default="float32",
                        help="Stored dtype (SAELens converts to its own on load).")
    export.set_defaults(dispatch_function=_export_saelens)
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["demo"] and not {"--verbose", "-h", "--help"} & set(argv):
        # Before vLLM is imported: its import-time logging belongs in the log too.
        from vllm_interp.demo import default_log_path, engine_output_to

        log = default_log_path()
        print(f"vLLM's own output goes to {log} (--verbose shows it here)")
        with engine_output_to(log) as terminal:
            _run(argv, terminal)
        return
    _run(argv, sys.stdout)


def _run(argv: list[str], out: TextIO) -> None:
    command = argv[0] if argv else None
    if command == "serve":
        from vllm_interp.server.serve_flags import check_before_vllm

        check_before_vllm(argv[1:])
    if command in ENGINE_COMMANDS:
        from vllm_interp.engine.versions import UnsupportedVllmVersion, adapter, check_vllm_version

        try:
            check_vllm_version()
        except UnsupportedVllmVersion as exc:
            sys.exit(f"error: {exc}")
        adapter("serve").cli_env_setup()
    args = build_parser(serve_options=command == "serve").parse_args(argv)
    args.terminal = out
    args.dispatch_function(args)


if __name__ == "__main__":
    main()
