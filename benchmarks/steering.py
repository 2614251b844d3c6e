"""Steering cost, as ratios against the same build with steering off, measured in one run.

    python -m benchmarks.steering [--model PATH] [--prompts 32] [--max-tokens 32] [--repeats 3]

Two engines on the same weights and settings: the baseline (no vllm-interp feature: plain vLLM) and one
with ``enable_steering``. Scenarios on the second: enabled but idle, global vectors, a named vector, one
shared inline vector, and N distinct per-request vectors (N = 1, 8, 32); vectors sit on every layer at
post_block. Throughput is generated tokens per second for a batch of prompts; per-token latency is the
time per generated token of a single request. Also the per-request cost of sending a spec as JSON floats
versus the compact base64 form (serialise, parse, validate).
"""

import json
import statistics
import time

import numpy as np
from vllm import LLM as VllmLLM

from benchmarks.common import engine_parser, engine_setup
from vllm_interp import LLM, pack_vectors, steered_params
from vllm_interp.hooks import ModelShape
from vllm_interp.steering.vectors import validate_steering


def spec_for(seed: int, layers: int, hidden: int) -> dict:
    """Vectors on every layer at post_block, in the compact form (what per-request senders should use)."""
    rng = np.random.default_rng(seed)
    return {"post_block": pack_vectors({layer: rng.standard_normal(hidden) * 0.5 for layer in range(layers)})}


def timed(llm, prompts, params, repeats: int) -> tuple[float, float]:
    """(generated tokens/s for the batch, seconds per token of a single request), medians."""
    batch, single = [], []
    single_params = params[0] if isinstance(params, list) else params
    # Untimed first pass: kernel JIT (Triton on GPU) and first-use allocations must not count.
    llm.generate(prompts, params, use_tqdm=False)
    llm.generate(prompts[:1], single_params, use_tqdm=False)
    for _ in range(repeats):
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        batch.append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start))
        start = time.perf_counter()
        out = llm.generate(prompts[:1], single_params, use_tqdm=False)[0]
        single.append((time.perf_counter() - start) / len(out.outputs[0].token_ids))
    return statistics.median(batch), statistics.median(single)


def wire_cost(layers: int, hidden: int, repeats: int = 20) -> dict[str, float]:
    shape = ModelShape(layers, hidden)
    vectors = {layer: np.random.default_rng(layer).standard_normal(hidden) for layer in range(layers)}
    forms = {
        "json_floats": {"post_block": {str(k): v.tolist() for k, v in vectors.items()}},
        "base64_float32": {"post_block": pack_vectors(vectors)},
        "base64_bfloat16": {"post_block": pack_vectors(vectors, dtype="bfloat16")},
    }
    out = {}
    for name, spec in forms.items():
        body = json.dumps({"steering_vectors": spec})
        start = time.perf_counter()
        for _ in range(repeats):
            validate_steering({"base": json.loads(body)["steering_vectors"]}, shape=shape, enabled=True)
        out[name] = {"bytes": len(body), "ms_per_request": 1000 * (time.perf_counter() - start) / repeats}
    return out


def main() -> None:
    parser = engine_parser(__doc__)
    args = parser.parse_args()
    model, engine, prompts, greedy = engine_setup(args)

    baseline_llm = VllmLLM(model, **engine)
    baseline = timed(baseline_llm, prompts, greedy, args.repeats)
    baseline_llm.llm_engine.engine_core.shutdown()

    llm = LLM(model, enable_steering=True, capture_consumers=(), max_steering_configs=32, **engine)
    layers, hidden = llm.num_layers, llm.llm_engine.model_config.get_hidden_size()
    shared = spec_for(0, layers, hidden)
    results = {"enabled, idle": timed(llm, prompts, greedy, args.repeats)}
    llm.set_steering(vectors=shared)
    results["global vectors"] = timed(llm, prompts, greedy, args.repeats)
    llm.clear_steering()
    llm.register_steering_vectors("bench", vectors=shared)
    results["named vector"] = timed(llm, prompts, steered_params(greedy, steering_name="bench"), args.repeats)
    results["one shared inline vector"] = timed(
        llm, prompts, steered_params(greedy, steering_vectors=shared), args.repeats)
    for n in (1, 8, 32):
        specs = [spec_for(i % n + 1, layers, hidden) for i in range(len(prompts))]
        params = [steered_params(greedy, steering_vectors=s) for s in specs]
        results[f"{n} distinct inline vectors"] = timed(llm, prompts, params, args.repeats)
    llm.shutdown()

    print(f"\nmodel {model}, {len(prompts)} prompts x {args.max_tokens} tokens, vectors on all {layers} layers "
          f"(post_block), dtype {args.dtype}, enforce_eager={args.enforce_eager}")
    print(f"{'scenario':<28}{'tok/s':>10}{'ratio':>8}{'ms/token (1 req)':>18}{'ratio':>8}")
    print(f"{'baseline (steering off)':<28}{baseline[0]:>10.1f}{1.0:>8.3f}{1000 * baseline[1]:>18.2f}{1.0:>8.3f}")
    for name, (tput, latency) in results.items():
        print(f"{name:<28}{tput:>10.1f}{tput / baseline[0]:>8.3f}{1000 * latency:>18.2f}{latency / baseline[1]:>8.3f}")
    print("\nper-request cost of one all-layer spec (serialise + parse + validate):")
    for name, cost in wire_cost(layers, hidden).items():
        print(f"  {name:<18}{cost['bytes']:>10} bytes{cost['ms_per_request']:>10.2f} ms")


if __name__ == "__main__":
    main()
