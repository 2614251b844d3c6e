"""The command line: `vllm-interp serve` runs where only the server's dependencies are installed (a GPU host
with `pip install ".[gpu]"`), without the client extra (httpx, httpx-sse, matplotlib)."""

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


def test_serve_gives_capture_consumers_a_shutdown_grace_period_unless_told():
    from vllm_interp.cli import build_parser
    from vllm_interp.engine.versions import adapter

    serve = adapter("serve")

    def chosen(*flags: str, capturing: bool) -> int:
        args = build_parser().parse_args(["serve", "some-model", *flags])
        serve.choose_shutdown_timeout(args, capturing=capturing)
        return args.shutdown_timeout

    assert chosen(capturing=True) == serve.CAPTURE_SHUTDOWN_TIMEOUT_S > 0
    assert chosen(capturing=False) == 0  # vLLM's default
    assert chosen("--shutdown-timeout", "0", capturing=True) == 0  # the user's choice stands
    assert chosen("--shutdown-timeout", "7", capturing=False) == 7
