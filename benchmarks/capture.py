"""Capture cost, as ratios against baselines measured in the same run.

    python -m benchmarks.capture [--model PATH] [--prompts 32] [--max-tokens 32] [--repeats 3] [--root DIR]

(a) Requests that do not capture, on an engine with capture consumers enabled, vs an engine without
    vllm-interp features (plain vLLM on the same build and settings).
(b) Capturing requests on the capture engine vs the same requests not capturing: ``last_prompt`` on every
    layer and hook, and ``all_prompt`` on a few layers, each to ``inline`` (rows back to the caller) and to
    ``filesystem`` (packed safetensors files).
(c) The filesystem consumer's write rate per layout, vs a plain sequential write (write + fsync) of the
    same bytes to the same disk, measured right after.
"""

import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from vllm import LLM as VllmLLM

from benchmarks.common import engine_parser, engine_setup
from vllm_interp import LLM
from vllm_interp.capture.consumer import CaptureMeta, ConsumerContext, RequestCapture
from vllm_interp.capture.consumers.filesystem import FilesystemConsumer


def throughput(llm, prompts, params, repeats: int, capture=None) -> float:
    """Generated tokens per second for the batch (median; results included when capturing)."""
    kwargs = {} if capture is None else {"capture": capture}
    llm.generate(prompts, params, use_tqdm=False, **kwargs)  # untimed warm-up
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False, **kwargs)
        rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start))
        for out in outs if capture is not None else ():
            assert all(r.status == "ok" for r in out.capture.values()), out.capture
    return statistics.median(rates)


def sequential_write(path: Path, data: bytes) -> float:
    start = time.perf_counter()
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    return time.perf_counter() - start


def filesystem_rates(root: Path, requests: int, positions: int, sites: int, hidden: int,
                     repeats: int) -> list[tuple]:
    """(layout, MB/s through the consumer, MB/s of a plain sequential write of the same bytes), medians; the
    plain write runs right before each consumer pass so both see the same disk state."""
    names = [f"{layer}.post_block" for layer in range(sites)]
    captures = [
        RequestCapture(
            CaptureMeta(request_id=f"req-{i}", tag=None, model="bench", prompt_len=positions,
                        positions=list(range(positions)), sites=names, dtype="float32"),
            {name: torch.randn(positions, hidden) for name in names},
        )
        for i in range(requests)
    ]
    total = sum(c.nbytes for c in captures)
    root.mkdir(parents=True, exist_ok=True)
    blob = b"".join(t.numpy().tobytes() for c in captures for t in c.tensors.values())
    rows = []
    for layout in ("packed", "per_file", "sharded"):
        consumer_s, plain_s = [], []
        for _ in range(repeats):
            target = root / layout
            shutil.rmtree(target, ignore_errors=True)
            plain_s.append(sequential_write(root / "plain.bin", blob))
            options = FilesystemConsumer.validate_engine_options({"root": str(target), "layout": layout})
            consumer = FilesystemConsumer(ConsumerContext(name="filesystem", options=options, model="bench",
                                                          num_layers=sites, hidden_size=hidden))
            start = time.perf_counter()
            for capture in captures:
                consumer.consume(capture)
            consumer.close()  # sharded: publishes the last shard
            consumer_s.append(time.perf_counter() - start)
        rows.append((layout, total / statistics.median(consumer_s) / 1e6, total / statistics.median(plain_s) / 1e6))
    return rows


def main() -> None:
    parser = engine_parser(__doc__)
    parser.add_argument("--root", default=None, help="filesystem consumer root (default: a temporary dir)")
    args = parser.parse_args()
    model, engine, prompts, greedy = engine_setup(args)
    root = Path(args.root or tempfile.mkdtemp(prefix="vllm-interp-bench-"))

    baseline_llm = VllmLLM(model, **engine)
    baseline = throughput(baseline_llm, prompts, greedy, args.repeats)
    baseline_llm.llm_engine.engine_core.shutdown()

    consumers = ("inline", f"filesystem:root={root / 'engine'},on_collision=overwrite")
    llm = LLM(model, capture_consumers=consumers, **engine)
    layers = llm.num_layers
    few = {"post_block": [0, layers // 2, layers - 1]}
    results = {"(a) not capturing": throughput(llm, prompts, greedy, args.repeats)}
    scenarios = {
        "last_prompt, all sites": {"hooks": "all", "positions": "last_prompt"},
        "all_prompt, 3 layers": {"hooks": few, "positions": "all_prompt"},
    }
    for label, spec in scenarios.items():
        for consumer in ("inline", "filesystem"):
            results[f"(b) {label} -> {consumer}"] = throughput(llm, prompts, greedy, args.repeats,
                                                               capture={consumer: spec})
    hidden = llm.llm_engine.model_config.get_hidden_size()
    llm.shutdown()

    print(f"\nmodel {model}, {len(prompts)} prompts x {args.max_tokens} tokens, dtype {args.dtype}, "
          f"enforce_eager={args.enforce_eager}")
    print(f"{'scenario':<46}{'tok/s':>10}{'ratio':>8}")
    print(f"{'baseline (plain vLLM, no capture)':<46}{baseline:>10.1f}{1.0:>8.3f}")
    for name, rate in results.items():
        reference = baseline if name.startswith("(a)") else results["(a) not capturing"]
        print(f"{name:<46}{rate:>10.1f}{rate / reference:>8.3f}")
    print("(b) ratios are against (a): the same engine, requests not capturing", flush=True)

    disk = filesystem_rates(root / "layouts", requests=64, positions=64, sites=layers, hidden=hidden,
                            repeats=args.repeats)
    shutil.rmtree(root, ignore_errors=True)
    print(f"\n(c) filesystem consumer, 64 requests x 64 positions x {layers} sites x {hidden} fp32, "
          f"median of {args.repeats}; plain = one file written sequentially, then fsync")
    print(f"{'layout':<12}{'MB/s':>10}{'plain write MB/s':>18}{'ratio':>8}")
    for layout, rate, plain in disk:
        print(f"{layout:<12}{rate:>10.1f}{plain:>18.1f}{rate / plain:>8.3f}")


if __name__ == "__main__":
    main()
