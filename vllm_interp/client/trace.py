"""`vllm-interp trace`: one causal-tracing sweep to a heatmap PNG, against a server or a local engine.

Without ``--server`` it starts `vllm-interp serve --enable-patching` on a free local port (the default model
unless ``--model``), runs the sweep, and stops the server.
"""

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

HOOK_CHOICES = ("pre_attn", "post_attn", "post_block")


def add_trace_parser(sub: argparse._SubParsersAction) -> None:
    trace = sub.add_parser("trace", help="Causal tracing: sweep a corrupt prompt against a clean one, write a heatmap.")
    trace.add_argument("--clean", required=True, help="The clean prompt.")
    trace.add_argument("--corrupt", required=True, help="The corrupt prompt.")
    trace.add_argument("--answer", required=True, help="The clean answer (exactly one token, e.g. ' Paris').")
    trace.add_argument("--foil", default=None, help="The corrupt answer (one token), for logit_diff.")
    trace.add_argument("--hooks", nargs="+", choices=HOOK_CHOICES, default=["post_block"])
    trace.add_argument("--metric", choices=("logprob", "logit_diff", "recovered"), default="recovered")
    trace.add_argument("--server", default=None, help="A running server (http://host:port); default: start one.")
    trace.add_argument("--api-key", default=None)
    trace.add_argument("--model", default=None, help="Model for the local server (default: SmolLM2-135M-Instruct).")
    trace.add_argument("--out", default="heatmap.png", help="Where to write the PNG.")
    trace.set_defaults(dispatch_function=run_trace)


def run_trace(args: argparse.Namespace) -> None:
    # The client extra, imported here: the rest of the command line (serve) must not need it.
    from vllm_interp.client.patch_study import PatchStudy

    with _server(args.server, args.model) as url, PatchStudy(url, api_key=args.api_key) as study:
        result = study.sweep(args.corrupt, clean_prompt=args.clean, answer=args.answer, foil=args.foil,
                             hooks=tuple(args.hooks), metric=args.metric)
        title = f"{args.metric}: {args.answer!r}" + (f" vs {args.foil!r}" if args.foil else "")
        path = result.heatmap(args.out, title=f"{title}\nclean: {args.clean!r}  corrupt: {args.corrupt!r}")
        layer, position = result.strongest(args.hooks[0])
        print(f"wrote {path}; strongest {args.hooks[0]} cell: layer {layer}, token {position} "
              f"({result.tokens[result.positions.index(position)]!r})")


@contextmanager
def _server(url: str | None, model: str | None) -> Iterator[str]:
    import httpx

    if url is not None:
        yield url
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "vllm_interp.cli", "serve", *([model] if model else []), "--enable-patching",
               "--dtype", "float32", "--port", str(port), "--host", "127.0.0.1"]
    print("starting a local server:", " ".join(command[2:]), file=sys.stderr)
    process = subprocess.Popen(command, start_new_session=True, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 900
        while True:
            if process.poll() is not None:
                raise SystemExit(f"error: the local server exited with {process.returncode}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                raise SystemExit("error: the local server did not start in 900 s")
            time.sleep(2)
        yield url
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
