"""The `vllm-interp` command: serve, trace, demo, models."""

import argparse
import sys


def _models(args: argparse.Namespace) -> None:
    from vllm_interp.models.registry import supported_architectures

    if args.models_command == "prepare":
        from vllm_interp.default_model import prepare_default_model

        print(prepare_default_model(force=args.force))
    else:
        print("\n".join(supported_architectures()))


def _demo(args: argparse.Namespace) -> None:
    from vllm_interp.demo import run_demo

    run_demo(model=args.model, prompt=args.prompt, max_tokens=args.max_tokens)


def build_parser() -> argparse.ArgumentParser:
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from vllm_interp.client.trace import add_trace_parser
    from vllm_interp.server.serve import add_serve_parser

    parser = FlexibleArgumentParser(
        prog="vllm-interp", description="Residual-stream steering, capture and patching inside vLLM."
    )
    sub = parser.add_subparsers(dest="subparser", required=True)
    add_serve_parser(sub)
    add_trace_parser(sub)

    demo = sub.add_parser("demo", help="Run the main job on the default model: a completion plus a read-out.")
    demo.add_argument("--model", default=None, help="Model path (default: SmolLM2-135M-Instruct).")
    demo.add_argument("--prompt", default="The capital of France is")
    demo.add_argument("--max-tokens", type=int, default=12)
    demo.set_defaults(dispatch_function=_demo)

    models = sub.add_parser("models", help="The default model and the supported architectures.")
    models_sub = models.add_subparsers(dest="models_command", required=True)
    prepare = models_sub.add_parser("prepare", help="Build SmolLM2-135M-Instruct (fp32) into the cache.")
    prepare.add_argument("--force", action="store_true", help="Rebuild even if present.")
    models_sub.add_parser("supported", help="List the architectures vllm-interp can hook.")
    models.set_defaults(dispatch_function=_models)
    return parser


def main(argv: list[str] | None = None) -> None:
    from vllm_interp.compat import UnsupportedVllmVersion, check_vllm_version

    try:
        check_vllm_version()
    except UnsupportedVllmVersion as exc:
        sys.exit(f"error: {exc}")
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup

    cli_env_setup()
    args = build_parser().parse_args(argv)
    args.dispatch_function(args)


if __name__ == "__main__":
    main()
