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
