"""Where the engine spends a burst of per-request steering configs: one engine, its core in this process.

    python -m benchmarks.steer_admission MODEL [--requests 128] [--prompt-tokens 512] [--rounds 2]
        [--attention-backend TRITON_ATTN] [--profile 25]

benchmarks/serve.py showed distinct per-request steering adding queue and prefill time inside the engine
(vLLM's own histograms) that one shared vector does not. This isolates that part: a batch of ``--requests``
prompts of ``--prompt-tokens`` random tokens, one generated token each (the step cost is prefill), sent to
one ``vllm_interp.LLM`` with the engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) as
unsteered, one shared all-layer vector, and distinct all-layer vectors per request, in turn for
``--rounds`` rounds, prefix caching off. Then one distinct batch runs under cProfile and the functions with
the most own time are printed, so the per-config cost shows where it is paid.
"""

import argparse
import cProfile
import os
import pstats
import statistics
import time

import numpy as np

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from vllm import SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402

from vllm_interp import LLM, pack_vectors, steered_params  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--attention-backend", default=None)
    parser.add_argument("--profile", type=int, default=25, help="functions to print (0: no profile)")
    args = parser.parse_args()

    engine = dict(max_model_len=args.prompt_tokens + 16, enable_prefix_caching=False, seed=0)
    if args.attention_backend:
        engine["attention_backend"] = args.attention_backend
    llm = LLM(args.model, enable_steering=True, max_steering_configs=args.requests, capture_consumers=(), **engine)
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
        if workload == "unsteered":
            return greedy
        if workload == "shared":
            return steered_params(greedy, steering_vectors=vectors(round_index + 1))
        return [steered_params(greedy, steering_vectors=vectors(10_000 * (round_index + 2) + i))
                for i in range(args.requests)]

    def batch_s(workload: str, round_index: int) -> float:
        batch, sampling = prompts(), params(workload, round_index)
        start = time.perf_counter()
        llm.generate(batch, sampling, use_tqdm=False)
        return time.perf_counter() - start

    workloads = ("unsteered", "shared", "distinct")
    for workload in workloads:  # untimed: Triton JIT, first-use allocations (pinned blocks included)
        batch_s(workload, -1)
    timings: dict[str, list[float]] = {w: [] for w in workloads}
    for round_index in range(args.rounds):
        for workload in workloads:
            timings[workload].append(batch_s(workload, round_index))
    base = statistics.median(timings["unsteered"])
    print(f"\n{args.requests} requests x {args.prompt_tokens} prompt tokens, 1 generated; vectors at post_block "
          f"of all {layers} layers (hidden {hidden}); seconds per batch, each round:")
    for workload, values in timings.items():
        extra = (statistics.median(values) - base) * 1e3 / args.requests
        print(f"  {workload:<10} {' '.join(f'{v:.3f}' for v in values)}  (median - unsteered: "
              f"{extra:+.2f} ms per request)")

    if args.profile:
        batch, sampling = prompts(), params("distinct", args.rounds)
        profile = cProfile.Profile()
        profile.enable()
        llm.generate(batch, sampling, use_tqdm=False)
        profile.disable()
        stats = pstats.Stats(profile)
        stats.sort_stats("tottime").print_stats(args.profile)
        stats.sort_stats("cumulative").print_stats("vllm_interp", args.profile)
    llm.shutdown()


if __name__ == "__main__":
    main()
