"""Patching throughput: a full layers x positions causal-tracing grid, in cells per second, against
transformers on the same machine, model and cells, measured in one run.

    python -m benchmarks.patching [--model PATH] [--repeats 3] [--hf-batch 64] [--hf-single-cells 60]

- vllm-interp: the clean prompt captured as a source run once, then every cell (one patched post_block row
  each, graded by the answer and foil logprobs at the first generated position) as one ``generate`` call:
  continuous batching, prefix caching (cells share the KV before their patched position).
- (a) transformers, batch 1: one forward per cell with a forward hook replacing the row.
- (b) transformers, batched: all cells in forwards of ``--hf-batch`` sequences, each row patched by its own
  (layer, position) through the same hooks.

Prints the grid's max answer/foil logprob difference between vllm-interp and (b) (they must agree), cells/s
for each, the ratios, and the rate of the same requests without patches (what the engine does anyway).
"""

import statistics
import time

import numpy as np
import torch
import transformers
from vllm import SamplingParams

from benchmarks.common import engine_parser, engine_setup
from vllm_interp import LLM, patched_params

CLEAN = "The Eiffel Tower is located in the city of"
CORRUPT = "The Colosseum is located in the city of"


def _layers(model):
    base = model.base_model
    return base.layers if hasattr(base, "layers") else base.h


def hf_grid(model, corrupt: list[int], clean_rows: torch.Tensor, cells: list[tuple[int, int]], batch: int,
            answer: int, foil: int) -> np.ndarray:
    """[cells, 2] answer/foil logprobs, ``batch`` cells per forward; ``clean_rows[layer, position]`` is the
    clean run's post_block row."""
    out = []
    layers = _layers(model)
    for start in range(0, len(cells), batch):
        chunk = cells[start : start + batch]
        targets = torch.tensor(chunk)

        def patch(_m, _a, output, layer, targets=targets):
            hidden = output[0] if isinstance(output, tuple) else output
            rows = torch.nonzero(targets[:, 0] == layer).flatten()
            if len(rows):
                positions = targets[rows, 1]
                hidden[rows, positions] = clean_rows[layer, positions]

        handles = [layer.register_forward_hook(lambda m, a, o, i=i: patch(m, a, o, i)) for i, layer in
                   enumerate(layers)]
        try:
            with torch.no_grad():
                logits = model(torch.tensor([corrupt] * len(chunk))).logits[:, -1].float()
        finally:
            for handle in handles:
                handle.remove()
        logprobs = torch.log_softmax(logits, dim=-1)
        out.append(logprobs[:, [answer, foil]].numpy())
    return np.concatenate(out)


def main() -> None:
    parser = engine_parser(__doc__)
    parser.add_argument("--hf-batch", type=int, default=64)
    parser.add_argument("--hf-single-cells", type=int, default=60, help="cells timed for the batch-1 loop")
    args = parser.parse_args()
    model_path, engine, _, _ = engine_setup(args)
    llm = LLM(model_path, enable_patching=True, max_num_seqs=256, **engine)
    tokenizer = llm.get_tokenizer()
    clean, corrupt = tokenizer(CLEAN).input_ids, tokenizer(CORRUPT).input_ids
    answer, foil = tokenizer(" Paris").input_ids[0], tokenizer(" Rome").input_ids[0]
    grade = SamplingParams(temperature=0.0, max_tokens=1, logprob_token_ids=[answer, foil])
    layers = llm.num_layers
    cells = [(layer, p) for layer in range(layers) for p in range(len(corrupt))]
    llm.generate([{"prompt_token_ids": clean}], grade, use_tqdm=False, capture={"patch_source": {
        "hooks": {"post_block": "all"}, "positions": "all_prompt", "tag": "bench-clean"}})
    params = [patched_params(grade, patch=[{"layer": layer, "hook": "post_block", "position": p,
                                             "source": {"run": "bench-clean", "position": p}}]) for layer, p in cells]
    prompts = [{"prompt_token_ids": corrupt}] * len(cells)
    llm.generate(prompts[:32], params[:32], use_tqdm=False)  # warm-up
    engine_rates, unpatched_rates, engine_grid = [], [], None
    for _ in range(args.repeats):  # interleaved: unpatched (the same requests without patches), patched
        start = time.perf_counter()
        llm.generate(prompts, grade, use_tqdm=False)
        unpatched_rates.append(len(cells) / (time.perf_counter() - start))
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        engine_rates.append(len(cells) / (time.perf_counter() - start))
        engine_grid = np.array([[o.outputs[0].logprobs[0][t].logprob for t in (answer, foil)] for o in outputs])
    llm.shutdown()

    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = model(torch.tensor([clean]), output_hidden_states=True).hidden_states
    # post_block of layer L is hidden_states[L + 1], except the last layer's (transformers applies the final
    # norm there): take it from a hook instead.
    clean_rows = torch.stack([hidden[i + 1][0] for i in range(layers - 1)] + [_last_block(model, clean)])
    batched_rates, single_rates, hf = [], [], None
    for _ in range(args.repeats):
        start = time.perf_counter()
        hf = hf_grid(model, corrupt, clean_rows, cells, args.hf_batch, answer, foil)
        batched_rates.append(len(cells) / (time.perf_counter() - start))
        subset = cells[:: max(1, len(cells) // args.hf_single_cells)]
        start = time.perf_counter()
        hf_grid(model, corrupt, clean_rows, subset, 1, answer, foil)
        single_rates.append(len(subset) / (time.perf_counter() - start))
    diff = float(np.max(np.abs(engine_grid - hf)))
    ours, batched, single = (statistics.median(r) for r in (engine_rates, batched_rates, single_rates))
    print(f"grid: {layers} layers x {len(corrupt)} positions = {len(cells)} cells (post_block), "
          f"max answer/foil logprob diff vs transformers {diff:.2e}")
    unpatched = statistics.median(unpatched_rates)
    print(f"vllm-interp            {ours:10.1f} cells/s   (the same requests unpatched: {unpatched:.1f}/s, "
          f"patching costs {unpatched / ours:.2f}x)")
    print(f"(a) transformers bs=1  {single:10.1f} cells/s   ratio {ours / single:6.2f}x")
    print(f"(b) transformers bs={args.hf_batch:<3}{batched:10.1f} cells/s   ratio {ours / batched:6.2f}x")


def _last_block(model, sequence: list[int]) -> torch.Tensor:
    captured = []
    handle = _layers(model)[-1].register_forward_hook(
        lambda _m, _a, out: captured.append((out[0] if isinstance(out, tuple) else out)[0].clone()))
    try:
        with torch.no_grad():
            model(torch.tensor([sequence]))
    finally:
        handle.remove()
    return captured[0]


if __name__ == "__main__":
    main()
