"""Capture on GPUs: CUDA graphs, tensor and pipeline parallelism give the rows a single eager engine gives.

On a random fp32 Llama (hidden 256, 4 layers), four prompts of 5-30 tokens, 6 greedy tokens, every site at
every computed position to ``inline`` and two sites to ``filesystem``, one engine per mode:

- ``eager``: the reference (one GPU, enforce_eager);
- ``graphs``: one GPU, torch.compile + CUDA graphs (capture steps run without graphs, decode steps of
  requests that do not capture keep them);
- ``tp2``: tensor parallel over 2 GPUs (rank 0 alone runs consumers);
- ``pp2``: pipeline parallel over 2 GPUs (each stage captures its layers; results merge).

Prints one ``GPU_CAPTURE {json}`` line per mode: max relative difference against ``eager`` over all sites,
result statuses, and the filesystem files it wrote.

    python benchmarks/gpu_capture_check.py MODE [--root DIR]
"""

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from vllm import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_parity import PROMPT_LENGTHS, build_llama  # noqa: E402
from vllm_interp.capture.consumers.filesystem import list_captures, read_capture  # noqa: E402

MODES = {
    "eager": dict(enforce_eager=True),
    "graphs": dict(enforce_eager=False),
    "tp2": dict(enforce_eager=True, tensor_parallel_size=2),
    "pp2": dict(enforce_eager=True, pipeline_parallel_size=2),
}
FILE_SITES = {"post_block": [1, 2]}


def run(mode: str, model: Path, root: Path) -> list[dict[str, torch.Tensor]]:
    from vllm_interp import LLM

    generator = torch.Generator().manual_seed(1)
    prompts = [{"prompt_token_ids": torch.randint(3, 500, (n,), generator=generator).tolist()}
               for n in PROMPT_LENGTHS]
    shutil.rmtree(root / mode, ignore_errors=True)
    llm = LLM(str(model), dtype="float32", attention_backend="TRITON_ATTN", skip_tokenizer_init=True,
              max_model_len=512, max_num_batched_tokens=16, max_num_seqs=8, gpu_memory_utilization=0.3, seed=0,
              capture_consumers=("inline", f"filesystem:root={root / mode}"), **MODES[mode])
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    captures = [{"inline": {"positions": "all"},
                 "filesystem": {"hooks": FILE_SITES, "positions": "all", "tag": f"req-{i}"}}
                for i in range(len(prompts))]
    outputs = llm.generate(prompts, greedy, capture=captures, use_tqdm=False)
    statuses = [{name: r.status for name, r in o.capture.items()} for o in outputs]
    messages = [m for o in outputs for r in o.capture.values() if (m := r.message)]
    rows = [dict(o.residuals.tensors) for o in outputs]
    llm.shutdown()
    written = list_captures(root / mode)
    for i, row in enumerate(rows):
        tensors, _ = read_capture(root / mode, f"req-{i}")
        assert all(torch.equal(tensors[name], row[name]) for name in tensors), f"{mode}: file != inline rows"
    torch.save(rows, root / f"{mode}.pt")
    print("GPU_CAPTURE " + json.dumps({"mode": mode, "statuses": statuses, "messages": messages[:4],
                                       "files": written, "sites": len(rows[0]),
                                       "rows": sum(t.shape[0] for r in rows for t in r.values())}), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=[*MODES, "compare"])
    parser.add_argument("--root", default="/tmp/interp-gpu-capture")
    args = parser.parse_args()
    root = Path(args.root)
    model = root / "llama"
    if args.mode == "compare":
        reference = torch.load(root / "eager.pt")
        for mode in MODES:
            if mode == "eager" or not (root / f"{mode}.pt").exists():
                continue
            rows = torch.load(root / f"{mode}.pt")
            worst = max(
                ((got[name] - want[name]).abs().max() / want[name].abs().max()).item()
                for got, want in zip(rows, reference, strict=True) for name in want
            )
            same_sites = all(list(got) == list(want) for got, want in zip(rows, reference, strict=True))
            print("GPU_CAPTURE_DIFF " + json.dumps({"mode": mode, "max_rel_diff_vs_eager": worst,
                                                    "same_sites_and_positions": same_sites}), flush=True)
        return
    if not model.exists():
        build_llama(model)
    run(args.mode, model, root)


if __name__ == "__main__":
    main()
