"""Clean shutdown, plain vLLM against vllm-interp: start a server, answer one request, send a signal, and list
the warnings and tracebacks it printed on the way out.

    python -m benchmarks.shutdown_check plain|interp SIGTERM|SIGINT

The vllm-interp server has steering, patching and the inline and filesystem consumers on, and the request
captures to files. Logs go to /tmp/shutdown/.
"""

import json
import signal
import sys
import time
import urllib.request
from pathlib import Path

from benchmarks.serving import VLLM_INTERP_MODULE, VLLM_MODULE, start_server

which, sig = sys.argv[1], getattr(signal, sys.argv[2])
model = str(Path.home() / ".cache/vllm-interp/models/SmolLM2-135M-Instruct")
common = [model, "--max-model-len", "512", "--enforce-eager", "--max-num-seqs", "4",
          "--kv-cache-memory-bytes", "134217728"]
extra = ["--enable-steering", "--enable-patching", "--capture-consumers", "inline",
         "--capture-consumers", "filesystem:root=/tmp/shutdown/caps"] if which == "interp" else []
Path("/tmp/shutdown").mkdir(exist_ok=True)
log = Path(f"/tmp/shutdown/{which}-{sys.argv[2]}.log")
url, proc = start_server(common + extra, log, program=VLLM_INTERP_MODULE if which == "interp" else VLLM_MODULE)
body = {"model": model, "prompt": "Hello", "max_tokens": 4}
if which == "interp":
    body["capture"] = {"filesystem": {"hooks": {"post_block": [1]}, "positions": "all"}}
req = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
print(urllib.request.urlopen(req, timeout=120).status)
proc.send_signal(sig)
rc = proc.wait(120)
time.sleep(3)
text = log.read_text()
leaks = [line for line in text.splitlines() if "leaked" in line or "Traceback" in line]
print(which, sys.argv[2], "rc", rc, "leak lines:", len(leaks))
for line in leaks:
    print("   ", line[:200])
