"""Where the engine spends a burst of requests with per-request fields (steering configs, a capture): one
engine, its core in this process.

    python -m benchmarks.steer_admission MODEL [--requests 128] [--prompt-tokens 512] [--rounds 2]
        [--workloads unsteered,shared,distinct,capture] [--attention-backend TRITON_ATTN] [--kv-cache-gib 1]
        [--inline inline:isolation=process]
        [--profile 25] [--profile-workload distinct]
        [--torch-profile unsteered,capture] [--trace-dir DIR] [--torch-stack] [--sync-check unsteered,distinct]
        [--engine-only] [--split]

benchmarks/serve.py showed per-request steering and capture adding queue and prefill time inside the engine
(vLLM's own histograms). This isolates that part: a batch of ``--requests`` prompts of ``--prompt-tokens``
random tokens, one generated token each (the step cost is prefill), sent to one ``vllm_interp.LLM`` (steering
and the ``inline`` consumer enabled, as the serving bench's server) with the engine core in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), in turn for ``--rounds`` rounds, prefix caching off: ``unsteered``
(no fields), ``shared`` (one all-layer vector for all), ``distinct`` (all-layer vectors per request) and
``capture`` (``last_prompt`` at every site to ``inline``, results collected). Then one batch of
``--profile-workload`` runs under cProfile and the functions with the most own time are printed, so the
per-request cost shows where it is paid; ``--torch-profile`` runs each named workload once under torch's
profiler and prints the operators and kernels by device time (host time without a GPU) and how much of the
batch's wall time the device was busy, so an engine-side cost shows on the device's timeline; ``--trace-dir``
also writes each profile's Chrome trace there (gzipped) for a look at the gaps between kernels, with every
Python call in it under ``--torch-stack`` (slow: for where the host waits, not for timings). ``--sync-check``
runs each named workload once with torch's CUDA sync debug mode on and prints every call that made the host
wait for the device, by Python call site (the innermost vLLM and vllm-interp frames), with counts: one such
call in a step stops the host from preparing the next step while the device runs this one.

``--engine-only`` times the engine alone: each batch's requests are validated and packed (vllm-interp's
offline front door, which a server runs on its API servers) before the clock starts, and their results
attached after it stops. ``--split`` adds, per workload, the median milliseconds a batch spends inside each of
a few engine functions (``function_timers.FUNCTIONS``; nested ones are inside their callers), so a per-request
cost shows on the engine's thread as scheduling, request admission, the runner's step or vllm-interp's plan.
"""

import argparse
import cProfile
import gzip
import os
import pstats
import statistics
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import vllm  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402

from benchmarks import function_timers  # noqa: E402
from vllm_interp import LLM, pack_vectors, steered_params  # noqa: E402

LAST_PROMPT_EVERYWHERE = {"inline": {"hooks": "all", "positions": "last_prompt"}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--attention-backend", default=None)
    parser.add_argument("--kv-cache-gib", type=float, default=None, help="KV cache size (the CPU needs one)")
    parser.add_argument("--workloads", default="unsteered,shared,distinct,capture")
    parser.add_argument("--inline", default="inline",
                        help="the inline consumer's --capture-consumers entry (inline:isolation=process: its own "
                             "process, off the worker's interpreter)")
    parser.add_argument("--profile", type=int, default=25, help="functions to print (0: no profile)")
    parser.add_argument("--profile-workload", default="distinct", help="the workload run under cProfile")
    parser.add_argument("--torch-profile", default="", help="workloads to run under torch's profiler")
    parser.add_argument("--torch-stack", action="store_true", help="record Python calls in the torch profiles")
    parser.add_argument("--trace-dir", default=None, help="where to write the profiles' Chrome traces")
    parser.add_argument("--sync-check", default="", help="workloads to run with CUDA sync debug mode on")
    parser.add_argument("--engine-only", action="store_true", help="the front door's work outside the timings")
    parser.add_argument("--split", action="store_true", help="time spent in a few engine functions per batch")
    args = parser.parse_args()
    spent = function_timers.time_functions() if args.split else {}

    engine = dict(max_model_len=args.prompt_tokens + 16, enable_prefix_caching=False, seed=0)
    if args.attention_backend:
        engine["attention_backend"] = args.attention_backend
    if args.kv_cache_gib:
        engine["kv_cache_memory_bytes"] = int(args.kv_cache_gib * (1 << 30))
    llm = LLM(args.model, enable_steering=True, max_steering_configs=args.requests,
              capture_consumers=(args.inline,), **engine)
    layers, hidden = llm.num_layers, llm.llm_engine.model_config.get_hidden_size()
    vocab = llm.llm_engine.model_config.get_vocab_size()
    greedy = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    rng = np.random.default_rng(0)

    def vectors(seed: int) -> dict:
        table = np.random.default_rng(seed).standard_normal((layers, hidden)).astype(np.float32) * 0.01
        return {"post_block": pack_vectors({layer: table[layer] for layer in range(layers)})}

    def prompts() -> list[TokensPrompt]:
        ids = rng.integers(100, vocab - 100, size=(args.requests, args.prompt_tokens)).tolist()
        return [TokensPrompt(prompt_token_ids=p) for p in ids]

    def params(workload: str, round_index: int) -> SamplingParams | list[SamplingParams]:
        if workload in ("unsteered", "capture"):
            return greedy
        if workload == "shared":
            return steered_params(greedy, steering_vectors=vectors(round_index + 1))
        return [steered_params(greedy, steering_vectors=vectors(10_000 * (round_index + 2) + i))
                for i in range(args.requests)]

    def batch_s(workload: str, round_index: int) -> float:
        batch, sampling = prompts(), params(workload, round_index)
        capture = {"capture": LAST_PROMPT_EVERYWHERE} if workload == "capture" else {}
        if args.engine_only:  # the front door first, untimed
            captures = llm._capture_specs(len(batch), capture.get("capture"), None)
            packed, prepared = llm._prepare(len(batch), sampling, captures, batch)
            def run() -> list:
                return vllm.LLM.generate(llm, batch, packed, use_tqdm=False)
        else:
            def run() -> list:
                return llm.generate(batch, sampling, use_tqdm=False, **capture)
        spent.clear()
        start = time.perf_counter()
        outputs = run()
        elapsed = time.perf_counter() - start
        if args.engine_only:
            outputs = llm._attach_results(outputs, prepared, strict=False)
        if capture:
            assert all(out.capture["inline"].status == "ok" for out in outputs)
        return elapsed

    workloads = args.workloads.split(",")
    for workload in workloads:  # untimed: Triton JIT, first-use allocations (pinned blocks included)
        batch_s(workload, -1)
    timings: dict[str, list[float]] = {w: [] for w in workloads}
    splits: dict[str, list[function_timers.Totals]] = {w: [] for w in workloads}
    for round_index in range(args.rounds):
        for workload in workloads:
            timings[workload].append(batch_s(workload, round_index))
            splits[workload].append({label: list(total) for label, total in spent.items()})
    base = statistics.median(timings["unsteered"]) if "unsteered" in timings else None
    print(f"\n{args.requests} requests x {args.prompt_tokens} prompt tokens, 1 generated; vectors at post_block "
          f"of all {layers} layers (hidden {hidden}), capture of every site; seconds per batch, each round:")
    for workload, values in timings.items():
        per_request_ms = None if base is None else (statistics.median(values) - base) * 1e3 / args.requests
        extra = "" if per_request_ms is None else f"  (median - unsteered: {per_request_ms:+.2f} ms a request)"
        print(f"  {workload:<10} {' '.join(f'{v:.3f}' for v in values)}{extra}")
    if args.split:
        labels = [function_timers.label_of(name) for name in function_timers.FUNCTIONS]
        print("\nms a batch inside each function (median of the rounds; nested functions are inside their callers):")
        print("  " + " | ".join(["function", *workloads]))
        for label in labels:
            medians = [statistics.median(s.get(label, [0.0])[0] for s in splits[w]) * 1e3 for w in workloads]
            if any(medians):
                print("  " + " | ".join([label, *(f"{m:.1f}" for m in medians)]))

    for workload in filter(None, args.torch_profile.split(",")):
        on_gpu = torch.cuda.is_available()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
        with torch.profiler.profile(activities=activities, with_stack=args.torch_stack) as prof:
            wall_s = batch_s(workload, args.rounds)
        print(f"\n## torch profile: {workload}\n")
        print(prof.key_averages().table(sort_by="self_cuda_time_total" if on_gpu else "self_cpu_time_total",
                                        row_limit=25, max_name_column_width=70))
        if on_gpu:
            print(f"device busy {_device_busy_s(prof) * 1e3:.1f} ms of the batch's {wall_s * 1e3:.1f} ms")
        if args.trace_dir:
            _write_trace(prof, os.path.join(args.trace_dir, f"{workload}.json.gz"))

    for workload in filter(None, args.sync_check.split(",")):
        sites = _synchronizing_calls(lambda workload=workload: batch_s(workload, args.rounds))
        print(f"\n## synchronizing CUDA calls: {workload} ({sum(sites.values())} in one batch)\n")
        for site, count in sites.most_common(20):
            print(f"  {count:6d}  {site}")

    if args.profile:
        profile = cProfile.Profile()
        profile.enable()
        batch_s(args.profile_workload, args.rounds + 1)
        profile.disable()
        stats = pstats.Stats(profile)
        stats.sort_stats("tottime").print_stats(args.profile)
        stats.sort_stats("cumulative").print_stats("vllm_interp", args.profile)
    llm.shutdown()


def _synchronizing_calls(run) -> Counter:
    """Run ``run()`` with torch's CUDA sync debug mode warning at each synchronizing call; count the calls by
    their innermost frames in vLLM and vllm-interp (a frame of each, where the stack has one)."""
    if not torch.cuda.is_available():
        return Counter()
    sites: Counter = Counter()

    def record(message, category, filename, lineno, file=None, line=None) -> None:
        if "synchroniz" not in str(message):
            return
        stack = [(f"{Path(f.filename).name}:{f.lineno} {f.name}", f.filename) for f in traceback.extract_stack()[:-1]]
        engine = [label for label, path in stack if "/vllm/" in path or "/vllm_interp/" in path]
        ours = [label for label, path in stack if "/vllm_interp/" in path]
        sites[" < ".join(reversed(engine[-3:])) + (f"  [ours: {ours[-1]}]" if ours else "")] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        shown, warnings.showwarning = warnings.showwarning, record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = shown
    return sites


def _device_busy_s(prof: torch.profiler.profile) -> float:
    """The union of the device's kernel and copy intervals (overlapping streams counted once)."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    busy_us, end = 0.0, float("-inf")
    for start, stop in spans:
        busy_us += max(0.0, stop - max(start, end))
        end = max(end, stop)
    return busy_us / 1e6


def _write_trace(prof: torch.profiler.profile, path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    plain = path.removesuffix(".gz")
    prof.export_chrome_trace(plain)
    with open(plain, "rb") as source, gzip.open(path, "wb") as target:
        target.write(source.read())
    os.remove(plain)


if __name__ == "__main__":
    main()
