"""`vllm-interp demo`: generate with the default model and read its residual stream.

The demo's own lines go to the terminal; vLLM's start-up logging, warnings and progress bars (from this
process and the engine's) go to a log file whose path is printed first, and whose tail is shown if the demo
fails. ``--verbose`` keeps everything on the terminal.
"""

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

from vllm_interp.default_model import cache_dir

LOG_TAIL_LINES = 40


def default_log_path() -> Path:
    return cache_dir() / "logs" / "demo.log"


@contextmanager
def engine_output_to(log: Path) -> Iterator[TextIO]:
    """Point this process's stdout and stderr (file descriptors 1 and 2, which engine processes inherit) at
    ``log``; yield a stream to the original stdout for the demo's own lines."""
    log.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    terminal = os.fdopen(os.dup(1), "w", buffering=1)
    with open(log, "w") as target:
        os.dup2(target.fileno(), 1)
        os.dup2(target.fileno(), 2)
    try:
        yield terminal
    except BaseException:
        sys.stdout.flush()
        sys.stderr.flush()
        tail = log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
        print(f"the demo failed; the last lines of {log}:\n" + "\n".join(tail), file=terminal)
        raise
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        terminal.close()


def run_demo(model: str | None, prompt: str, max_tokens: int, out: TextIO = sys.stdout) -> None:
    from vllm import SamplingParams

    from vllm_interp.llm import LLM

    def say(line: str = "") -> None:
        print(line, file=out)

    say("starting the engine (about 2 minutes on 2 CPU cores) ...")
    llm = LLM(model, dtype="float32", max_model_len=1024, kv_cache_memory_bytes=256 << 20, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    (output,) = llm.generate([prompt], params, readout={"positions": "all"}, use_tqdm=False)
    readout = output.residuals
    completion = output.outputs[0].text
    say(f"\nprompt:     {prompt!r}\ncompletion: {completion!r}\n")
    last = len(output.prompt_token_ids) - 1
    say(f"residual read-out: {len(readout.sites)} sites x {len(readout.positions)} positions "
        f"(prompt {last + 1} tokens + {len(readout.positions) - last - 1} generated)")
    say(f"L2 norm of the stream at the last prompt token (position {last}):")
    say(f"{'layer':>5} {'pre_attn':>10} {'post_attn':>10} {'post_block':>11}")
    pre, mid, post = (readout.stack(hook)[:, last].norm(dim=-1) for hook in ("pre_attn", "post_attn", "post_block"))
    for layer in range(pre.shape[0]):
        say(f"{layer:>5} {pre[layer]:>10.2f} {mid[layer]:>10.2f} {post[layer]:>11.2f}")
    # post_block(L) and pre_attn(L + 1) are the same stream, read at two different sites.
    chain = (readout.stack("post_block")[:-1] - readout.stack("pre_attn")[1:]).abs().max().item()
    say(f"max |post_block(L) - pre_attn(L+1)| over all positions: {chain:.1e}")
    llm.shutdown()
