"""Steering under CUDA graphs: graph replays must steer exactly as eager steps do.

Runs the same steered requests (per-request base, prefill and decode tiers, a mixed batch with an
unsteered request, global vectors, then clear) on a random fp32 Llama twice, with CUDA graphs and with
enforce_eager, and prints one `GPU_STEERING {json}` line: max logprob difference between the modes per
case, and whether clearing restored the unsteered baseline.

    python benchmarks/gpu_steering_check.py
"""

import json
import sys
from pathlib import Path

import numpy as np
import torch
from vllm import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_parity import PROMPT_LENGTHS, build_llama  # noqa: E402
from vllm_interp import LLM, steered_params  # noqa: E402

HIDDEN, LAYERS = 256, 4


def run(path: Path, prompts: list[list[int]], eager: bool) -> dict[str, list[float]]:
    llm = LLM(str(path), dtype="float32", enforce_eager=eager, attention_backend="TRITON_ATTN",
              skip_tokenizer_init=True, max_model_len=512, gpu_memory_utilization=0.3, enable_steering=True,
              capture_consumers=(), seed=0)
    rng = np.random.default_rng(0)
    spec = {"post_block": {str(layer): (rng.standard_normal(HIDDEN) * 2).tolist() for layer in range(LAYERS)}}
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    cases = {
        "unsteered": greedy,
        "base": steered_params(greedy, steering_vectors=spec),
        "prefill": steered_params(greedy, prefill_steering_vectors=spec),
        "decode": steered_params(greedy, decode_steering_vectors=spec),
    }
    inputs = [{"prompt_token_ids": p} for p in prompts]

    def logprobs(outs):
        return [lp[t].logprob for o in outs for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids,
                                                               strict=True)]

    result = {name: logprobs(llm.generate(inputs, params, use_tqdm=False)) for name, params in cases.items()}
    mixed = llm.generate(inputs[:2], [cases["base"], greedy], use_tqdm=False)
    result["mixed_unsteered"] = logprobs(mixed[1:])
    result["pair_unsteered"] = logprobs(llm.generate(inputs[:2], greedy, use_tqdm=False)[1:])
    llm.set_steering(vectors=spec)
    result["global"] = logprobs(llm.generate(inputs, greedy, use_tqdm=False))
    llm.clear_steering()
    result["after_clear"] = logprobs(llm.generate(inputs, greedy, use_tqdm=False))
    llm.shutdown()
    return result


def main() -> None:
    path = build_llama(Path("/tmp/interp-gpu-llama"))
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 500, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]
    graphs, eager = run(path, prompts, eager=False), run(path, prompts, eager=True)
    diff = {name: float(np.max(np.abs(np.subtract(graphs[name], eager[name])))) for name in graphs}
    moved = {name: float(np.max(np.abs(np.subtract(graphs[name], graphs["unsteered"]))))
             for name in ("base", "prefill", "decode", "global")}
    record = dict(
        device=torch.cuda.get_device_name(0),
        max_logprob_diff_graphs_vs_eager=diff,
        steering_moved_logprobs_by=moved,
        after_clear_vs_unsteered={mode: float(np.max(np.abs(np.subtract(r["after_clear"], r["unsteered"]))))
                                  for mode, r in (("graphs", graphs), ("eager", eager))},
        # the unsteered request of a [steered, unsteered] batch vs the same request in an all-unsteered batch
        mixed_batch_unsteered_vs_plain={mode: float(np.max(np.abs(np.subtract(r["mixed_unsteered"],
                                                                             r["pair_unsteered"]))))
                                        for mode, r in (("graphs", graphs), ("eager", eager))},
    )
    print("GPU_STEERING " + json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
