"""Residual-stream parity on a GPU with CUDA graphs on (not enforce_eager).

Builds a random fp32 Llama with transformers, runs four prompts through vllm_interp.LLM (V1 runner,
torch.compile + FULL_AND_PIECEWISE CUDA graphs, TRITON_ATTN) with every site read at every position,
and compares with transformers' fp32 forward on the same tokens. Prints one `GPU_PARITY {json}` line.

    python benchmarks/gpu_parity.py [--eager] [--out results.json]
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.parity import REL_TOL, compare, engine_sequences_and_readouts, hf_residuals  # noqa: E402
from tests.zoo import _input_of  # noqa: E402

PROMPT_LENGTHS = (5, 19, 7, 30)


def build_llama(path: Path) -> Path:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                      max_position_embeddings=1024, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.02)
    model.save_pretrained(path, safe_serialization=True)
    return path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--eager", action="store_true")
    parser.add_argument("--model-dir", default="/tmp/interp-gpu-llama")
    parser.add_argument("--out", default=None)
    parser.add_argument("--save", default=None, help="save the read-outs here (torch.save)")
    parser.add_argument("--compare-with", default=None, help="read-outs saved by another mode, to diff against")
    args = parser.parse_args()

    from vllm_interp import LLM

    path = build_llama(Path(args.model_dir))
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 500, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]
    start = time.perf_counter()
    llm = LLM(str(path), dtype="float32", enforce_eager=args.eager, attention_backend="TRITON_ATTN",
              skip_tokenizer_init=True, max_model_len=512, max_num_batched_tokens=16, max_num_seqs=8,
              gpu_memory_utilization=0.3, seed=0)
    init_s = time.perf_counter() - start
    sequences, readouts = engine_sequences_and_readouts(llm, prompts, max_tokens=6)
    mode = llm.llm_engine.vllm_config.compilation_config.cudagraph_mode
    llm.shutdown()
    references = hf_residuals(path, sequences, _input_of("post_attention_layernorm"))
    # Measured, not asserted here: the record says whether it meets the CPU suite's tolerance.
    result = compare(readouts, references, num_layers=4, rel_tol=float("inf"))
    if args.save:
        torch.save([r.tensors for r in readouts], args.save)
    mode_diff = None
    if args.compare_with:
        other = torch.load(args.compare_with)
        pairs = zip(readouts, other, strict=True)
        mode_diff = max((r.tensors[name] - o[name]).abs().max().item() for r, o in pairs for name in o)
    record = dict(
        device=torch.cuda.get_device_name(0), torch=torch.__version__, eager=args.eager, cudagraph_mode=str(mode),
        sites_checked=result.sites_checked, rows_checked=result.rows_checked,
        max_abs_diff=result.max_abs_diff, max_rel_diff=result.max_rel_diff,
        within_cpu_suite_tolerance=result.max_rel_diff <= REL_TOL,
        engine_init_s=round(init_s, 1), max_abs_diff_vs_other_mode=mode_diff,
    )
    print("GPU_PARITY " + json.dumps(record), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
