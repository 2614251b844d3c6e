"""The command line: `vllm-interp serve` runs where only the server's dependencies are installed (a GPU host
with `pip install ".[gpu]"`), without the client extra (httpx, httpx-sse, matplotlib); the other commands and
the top-level help answer without importing vLLM."""

import os
import subprocess
import sys

BLOCK_CLIENT_EXTRA = """
import sys
for name in ("httpx", "httpx_sse", "matplotlib"):
    sys.modules[name] = None  # importing it now raises ImportError, as where it is not installed
from vllm_interp.cli import build_parser
args = build_parser().parse_args(["serve", "some-model", "--enable-steering"])
print(args.enable_steering, args.dispatch_function is not None)
"""


def test_serve_parses_without_the_client_extra():
    done = subprocess.run([sys.executable, "-c", BLOCK_CLIENT_EXTRA], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "True True"


def test_serve_gives_capture_consumers_a_shutdown_grace_period_unless_told(monkeypatch):
    from vllm_interp.cli import build_parser
    from vllm_interp.engine.versions import adapter

    serve = adapter("serve")

    def chosen(*flags: str, capturing: bool) -> tuple[int, str | None]:
        """The engine's shutdown timeout and the worker's (None: vLLM's default)."""
        args = build_parser().parse_args(["serve", "some-model", *flags])
        with monkeypatch.context() as env:
            env.delenv(serve.WORKER_SHUTDOWN_ENV, raising=False)
            serve.choose_shutdown_timeout(args, capturing=capturing)
            return args.shutdown_timeout, os.environ.get(serve.WORKER_SHUTDOWN_ENV)

    grace = serve.CAPTURE_SHUTDOWN_TIMEOUT_S
    assert grace > 0
    assert chosen(capturing=True) == (grace, str(grace))  # workers get the grace period to close consumers
    assert chosen(capturing=False) == (0, None)  # vLLM's defaults
    assert chosen("--shutdown-timeout", "0", capturing=True) == (0, None)  # the user's choice stands
    assert chosen("--shutdown-timeout", "7", capturing=False) == (7, None)
    assert chosen("--shutdown-timeout", "7", capturing=True) == (7, "7")
    monkeypatch.setenv(serve.WORKER_SHUTDOWN_ENV, "3")
    args = build_parser().parse_args(["serve", "some-model"])
    serve.choose_shutdown_timeout(args, capturing=True)
    assert os.environ[serve.WORKER_SHUTDOWN_ENV] == "3"  # the user's setting stands


def test_commands_other_than_serve_answer_without_importing_vllm():
    # Importing vLLM takes 10-20 s here: the top-level help, trace's and the models listing need none of it.
    code = ("import sys\nfrom vllm_interp.cli import main\n"
            "for argv in (['--help'], ['trace', '--help'], ['models', 'supported']):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "print('imported vllm:', 'vllm' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "serve" in out and "LlamaForCausalLM" in out
    assert out.rstrip().endswith("imported vllm: False")
