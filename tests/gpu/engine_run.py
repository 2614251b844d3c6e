"""One engine mode of the GPU tests, run in a process of its own; saves what the tests compare.

    python -m tests.gpu.engine_run MODE MODEL_DIR CAPTURE_ROOT OUT.pt

Each mode is one ``vllm_interp.LLM`` on the same random fp32 Llama: ``eager`` (one GPU, the reference),
``graphs`` (one GPU, torch.compile + CUDA graphs), ``tp2`` and ``pp2`` (two GPUs, eager), ``tp2_graphs`` (two
GPUs, graphs) and ``graphs_mp`` (``graphs`` with the engine core in its own process), all on the model runner
vLLM picks (V2), and ``v1_eager``, ``v1_graphs`` (``eager``, ``graphs`` on the V1 runner). It runs the same
workloads in every mode (parity read-outs, capture to consumers; a patch grid in the first four; steering in
``STEERED_MODES``; last, the parity prompts with no capture) and saves plain data (tensors, lists, strings), so
the tests can compare modes.
One engine per process, with the engine core in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set by the
caller) except in ``MULTIPROCESS_MODES``: that is how these checks first ran on the device (an engine core in
its own process once hung at start there; ``graphs_mp`` is the check of vLLM's default), and a fresh process
leaves no CUDA or distributed state from one engine to the next. ``graphs_mp`` starts its engine
``MP_STARTS`` times in all (the later starts only generate once), to probe that start-up hang.
"""

import faulthandler
import gc
import os
import sys
import threading
import time
from pathlib import Path

import torch
import transformers
from vllm import SamplingParams

from tests.parity import engine_sequences_and_readouts
from vllm_interp import LLM, patched_params, steered_params
from vllm_interp.hooks import HOOKS

HIDDEN, LAYERS = 256, 4
# Lengths 19 and 30 exceed the 16-token step, so prompts are chunked and mixed with decode steps.
PROMPT_LENGTHS = (5, 19, 7, 30)
GREEDY = dict(temperature=0.0, max_tokens=6, ignore_eos=True)
FILE_SITES = {"post_block": [1, 2]}
# The token ids a patch grid is graded by (the answer's and the foil's logprob at the first generated token).
PATCH_GRADED = (17, 42)
# The graph modes on one GPU read at most 8 rows inside a replayed graph: steps capturing more (prefill chunks of
# 16 tokens) run eagerly, so both ways a capturing step runs are compared with eager's rows.
MODES = {
    "eager": dict(enforce_eager=True),
    "graphs": dict(enforce_eager=False, max_graph_capture_rows=8),
    "v1_eager": dict(enforce_eager=True),
    "v1_graphs": dict(enforce_eager=False, max_graph_capture_rows=8),
    "tp2": dict(enforce_eager=True, tensor_parallel_size=2),
    "pp2": dict(enforce_eager=True, pipeline_parallel_size=2),
    "tp2_graphs": dict(enforce_eager=False, tensor_parallel_size=2),
    "graphs_mp": dict(enforce_eager=False),
}
# Steering under graphs is the question, on one GPU and across two with TP (graph replays on every rank).
STEERED_MODES = ("eager", "graphs", "tp2_graphs", "graphs_mp", "v1_eager", "v1_graphs")
# The patch grid is compared in test_patching.py for these modes only; the others skip it to save device time.
PATCHED_MODES = ("eager", "graphs", "tp2", "pp2", "v1_eager", "v1_graphs")
# Modes on vLLM's V1 model runner (the caller sets VLLM_USE_V2_MODEL_RUNNER=0); the others run on the one vLLM
# picks for this model on a GPU, V2.
V1_MODES = ("v1_eager", "v1_graphs")
# Modes whose engine core runs in its own process (vLLM's default; the caller sets the variable per mode).
MULTIPROCESS_MODES = ("graphs_mp",)
# Engine starts in a multiprocess mode's process: the first runs the workloads, the others probe the start-up
# hang again (the frontend then holds the earlier engines' consumer threads, and maybe CUDA, when it starts).
MP_STARTS = 3
# A graph-mode start took 51 s cold and 30 s warm on an H100; a start still running after this is taken as stuck
# and the frontend's threads are dumped (tests/gpu/modes.py dumps every process's when it kills the mode).
START_STUCK_S = 150


def gpus_needed(mode: str) -> int:
    return MODES[mode].get("tensor_parallel_size", 1) * MODES[mode].get("pipeline_parallel_size", 1)


def build_llama(path: Path) -> Path:
    """A random fp32 Llama, small enough to build on the device (weights cannot travel) in a second."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=HIDDEN, intermediate_size=512, num_hidden_layers=LAYERS,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                      max_position_embeddings=1024, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config).to(torch.float32)
    # As tests/zoo.py does: default init leaves norms at 1 and biases at 0, which could hide a wrong tensor.
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.02)
    model.save_pretrained(path, safe_serialization=True)
    return path


def prompts(seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


def _readout_data(readouts) -> list[dict | None]:
    return [None if r is None else {"positions": list(r.positions), "tensors": dict(r.tensors)} for r in readouts]


def capture_to_consumers(llm) -> dict:
    """Every site at every position inline, two sites to files (tagged ``req-i``)."""
    inputs = [{"prompt_token_ids": p} for p in prompts(1)]
    captures = [{"inline": {"positions": "all"},
                 "filesystem": {"hooks": FILE_SITES, "positions": "all", "tag": f"req-{i}"}}
                for i in range(len(inputs))]
    outputs = llm.generate(inputs, SamplingParams(**GREEDY), capture=captures, use_tqdm=False)
    return {
        "statuses": [{name: r.status for name, r in o.capture.items()} for o in outputs],
        "messages": [m for o in outputs for r in o.capture.values() if (m := r.message)],
        # The parity workload's prompts again: whether a mode's greedy tokens repeat within one engine.
        "tokens": [list(o.outputs[0].token_ids) for o in outputs],
        # A failed inline result leaves no rows; the statuses say why.
        "readouts": _readout_data(getattr(o, "residuals", None) for o in outputs),
    }


def steer(llm) -> dict[str, list[float]]:
    """Logprobs of the sampled tokens for each steering case (vectors at every site of every layer)."""
    generator = torch.Generator().manual_seed(2)
    spec = {hook: {str(layer): (torch.randn(HIDDEN, generator=generator) * 2).tolist() for layer in range(LAYERS)}
            for hook in HOOKS}
    logprobs_params = SamplingParams(**GREEDY, logprobs=0)
    cases = {
        "unsteered": logprobs_params,
        "base": steered_params(logprobs_params, steering_vectors=spec),
        "prefill": steered_params(logprobs_params, prefill_steering_vectors=spec),
        "decode": steered_params(logprobs_params, decode_steering_vectors=spec),
    }
    # Other prompts than the capture workload's, so that prefix-cache hits stay within this workload.
    inputs = [{"prompt_token_ids": p} for p in prompts(2)]

    def logprobs(outputs) -> list[float]:
        return [step[token].logprob for o in outputs
                for step, token in zip(o.outputs[0].logprobs, o.outputs[0].token_ids, strict=True)]

    result = {name: logprobs(llm.generate(inputs, params, use_tqdm=False)) for name, params in cases.items()}
    mixed = llm.generate(inputs[:2], [cases["base"], cases["unsteered"]], use_tqdm=False)
    result["mixed_unsteered"] = logprobs(mixed[1:])
    result["pair_unsteered"] = logprobs(llm.generate(inputs[:2], cases["unsteered"], use_tqdm=False)[1:])
    llm.set_steering(vectors=spec)
    result["global"] = logprobs(llm.generate(inputs, cases["unsteered"], use_tqdm=False))
    llm.clear_steering()
    result["after_clear"] = logprobs(llm.generate(inputs, cases["unsteered"], use_tqdm=False))
    return result


def patch(llm) -> dict:
    """Every (hook, layer, position) cell of a corrupt prompt patched from a clean run captured in the same
    mode, graded by the answer and foil logprobs at the first generated position."""
    clean, corrupt = prompts(3)[2], prompts(3)[2].copy()
    corrupt[2], corrupt[4] = (corrupt[2] + 7) % 500, (corrupt[4] + 11) % 500
    grade = SamplingParams(temperature=0.0, max_tokens=1, logprob_token_ids=list(PATCH_GRADED))
    llm.generate([{"prompt_token_ids": clean}], grade, use_tqdm=False,
                 capture={"patch_source": {"hooks": "all", "positions": "all_prompt", "tag": "clean"}})
    cells = [(hook, layer, p) for hook in HOOKS for layer in range(LAYERS) for p in range(len(corrupt))]
    params = [patched_params(grade, patch=[{"layer": layer, "hook": hook, "position": p,
                                             "source": {"run": "clean", "position": p}}]) for hook, layer, p in cells]
    outputs = llm.generate([{"prompt_token_ids": corrupt}] * len(cells), params, use_tqdm=False)
    return {"clean": clean, "corrupt": corrupt, "cells": cells,
            "statuses": [o.patch.status for o in outputs],
            "logprobs": [[o.outputs[0].logprobs[0][t].logprob for t in PATCH_GRADED] for o in outputs]}


def start_engine(mode: str, model: Path, capture_root: Path) -> tuple[LLM, dict]:
    """The mode's engine, and how its start went (seconds, the engine core client, what the frontend held)."""
    before = {"cuda_initialized": torch.cuda.is_initialized(),
              "threads": sorted(t.name for t in threading.enumerate())}
    # Evidence if the start hangs: where the frontend waits (the engine core's stacks come from modes.py).
    faulthandler.dump_traceback_later(START_STUCK_S, exit=False)
    start = time.perf_counter()
    try:
        llm = LLM(str(model), dtype="float32", attention_backend="TRITON_ATTN", skip_tokenizer_init=True,
                  max_model_len=512, max_num_batched_tokens=16, max_num_seqs=8, gpu_memory_utilization=0.3, seed=0,
                  capture_consumers=("inline", f"filesystem:root={capture_root}"),
                  enable_steering=mode in STEERED_MODES, enable_patching=mode in PATCHED_MODES, **MODES[mode])
    finally:
        faulthandler.cancel_dump_traceback_later()
    seconds = time.perf_counter() - start
    # vLLM forks the engine core unless CUDA is initialized here, and says so by setting this variable.
    start_info = {"init_s": seconds, "engine_core": type(llm.llm_engine.engine_core).__name__,
                  "method": os.environ.get("VLLM_WORKER_MULTIPROC_METHOD", "fork"), **before}
    print(f"engine_run {mode}: engine started in {seconds:.1f} s ({start_info['engine_core']}, "
          f"{start_info['method']}, CUDA initialized before: {before['cuda_initialized']})", flush=True)
    return llm, start_info


def run(mode: str, model: Path, capture_root: Path) -> dict:
    llm, start_info = start_engine(mode, model, capture_root)
    result = {"mode": mode, "engine_init_s": start_info["init_s"], "starts": [start_info],
              "cudagraph_mode": str(llm.llm_engine.vllm_config.compilation_config.cudagraph_mode),
              "runners": [sites["runner"] for sites in llm.describe_sites()]}
    sequences, readouts = engine_sequences_and_readouts(llm, prompts(1), max_tokens=GREEDY["max_tokens"])
    result["parity"] = {"sequences": sequences, "readouts": _readout_data(readouts)}
    result["capture"] = capture_to_consumers(llm)
    if mode in PATCHED_MODES:
        result["patching"] = patch(llm)
    if mode in STEERED_MODES:
        result["steering"] = steer(llm)
    result["capture_steps"] = llm.collective_rpc("interp_capture_steps")
    # The parity prompts a third time, with no capture: tells a wrong forward from a capture that disturbs it.
    plain = llm.generate([{"prompt_token_ids": p} for p in prompts(1)], SamplingParams(**GREEDY), use_tqdm=False)
    result["plain_tokens"] = [list(o.outputs[0].token_ids) for o in plain]
    llm.shutdown()
    if mode in MULTIPROCESS_MODES:
        # The later starts generate once each (the tests hold their tokens to the first engine's).
        result["restart_tokens"] = []
        for _ in range(MP_STARTS - 1):
            del llm
            gc.collect()
            # A root of its own: under the mode's root it would be listed as a capture.
            restart_root = capture_root.with_name(f"{capture_root.name}-restart-{len(result['starts'])}")
            llm, start_info = start_engine(mode, model, restart_root)
            result["starts"].append(start_info)
            output = llm.generate([{"prompt_token_ids": prompts(1)[0]}], SamplingParams(**GREEDY), use_tqdm=False)
            result["restart_tokens"].append(list(output[0].outputs[0].token_ids))
            llm.shutdown()
    return result


if __name__ == "__main__":
    mode, model, capture_root, out = sys.argv[1:]
    torch.save(run(mode, Path(model), Path(capture_root)), out)
    print(f"engine_run {mode}: done", flush=True)
