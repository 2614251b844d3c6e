"""Capture under CUDA graphs, tensor parallel 2 (eager and with graphs), pipeline parallel 2, with the engine
core in its own process and on vLLM's V1 runner gives the rows one eager GPU (V2) gives, and every consumer gets
every row."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.gpu.engine_run import FILE_SITES, GREEDY, LAYERS, MODES, PROMPT_LENGTHS
from tests.gpu.modes import print_figure, readouts, report, with_eager
from tests.parity import compare
from vllm_interp.capture.consumers.filesystem import list_captures, read_capture
from vllm_interp.capture.consumers.inline import ResidualReadout
from vllm_interp.hooks import HOOKS, site_name

pytestmark = pytest.mark.gpu

# Same model, same fp32 arithmetic up to kernel fusion and reduction order: gpu-tests-2026-11-26.md measured
# 6.3e-5 (graphs: Inductor's fused kernels), 1.7e-4 (TP2: all-reduce order; TP2 with graphs too, once its
# ranks agreed on which steps run without graphs) and 0 (PP2) of a row's magnitude against eager. 5e-4 is 3x the
# worst of them and 10x tighter than the bound against transformers.
SAME_MODEL_REL_TOL = 5e-4
# Every mode but the reference; the one-GPU modes first, so that they start side by side.
OTHER_MODES = ["graphs", "graphs_mp", "v1_eager", "v1_graphs", "tp2", "tp2_graphs", "pp2"]


def _last_layer_logprobs(model: Path, row: torch.Tensor) -> torch.Tensor:
    """Next-token logprobs from the last layer's ``post_block`` row: the final RMSNorm and lm_head, on the CPU."""
    weights = load_file(model / "model.safetensors")
    eps = json.loads((model / "config.json").read_text())["rms_norm_eps"]
    row = row.double()
    normed = row * torch.rsqrt(row.pow(2).mean() + eps) * weights["model.norm.weight"].double()
    return torch.log_softmax(weights["lm_head.weight"].double() @ normed, dim=-1)


def _divergences(model: Path, mode: str, results: dict[str, dict]) -> list[int]:
    """Per sequence of the parity workload, the first position whose token differs from eager's (its length if
    none). Each divergence is printed as evidence: eager's logprob margin for its token over the mode's (a near
    tie would be rounding, a large margin a wrong forward pass), the margin the mode's own rows give, and
    whether the mode's later runs of the same prompts (the capture workload; one with no capture) generated
    eager's tokens."""
    got, want = results[mode]["parity"], results["eager"]["parity"]
    last = f"{LAYERS - 1}.post_block"
    ends = []
    for i, (g, w) in enumerate(zip(got["sequences"], want["sequences"], strict=True)):
        d = next((j for j, (a, b) in enumerate(zip(g, w, strict=True)) if a != b), len(w))
        ends.append(d)
        if d == len(w):
            continue
        # The token at d was sampled from the logits of row d - 1.
        eager = _last_layer_logprobs(model, want["readouts"][i]["tensors"][last][d - 1])
        other = _last_layer_logprobs(model, got["readouts"][i]["tensors"][last][d - 1])
        gap = float(eager[w[d]] - eager[g[d]])
        # A parity sequence holds every generated token but the last after the prompt.
        runs = {"capture": results[mode]["capture"]["tokens"][i], "no-capture": results[mode]["plain_tokens"][i]}
        later = {run: "eager's" if tokens[:-1] == w[PROMPT_LENGTHS[i]:] else "other" for run, tokens in runs.items()}
        print_figure(f"{mode} greedy divergence", f"request {i} position {d}: eager picks {w[d]} over {mode}'s "
                                                  f"{g[d]} by {gap:.2e} logprob, {mode}'s rows by "
                                                  f"{float(other[w[d]] - other[g[d]]):.2e}; later runs gave "
                                                  + ", ".join(f"{v} tokens ({k})" for k, v in later.items()))
    return ends


@pytest.mark.parametrize("mode", OTHER_MODES)
def test_rows_match_single_gpu_eager(engines, mode):
    results = with_eager(engines, mode)
    # A graph mode must really have graphs, or this would be a second eager run.
    assert ("NONE" in results[mode]["cudagraph_mode"]) == MODES[mode]["enforce_eager"], results[mode]["cudagraph_mode"]
    got, want = results[mode]["parity"], results["eager"]["parity"]
    ends = _divergences(engines.model, mode, results)
    # Rows up to each divergence (all of them where the tokens agree; later rows read other tokens), so that a
    # divergence fails here with the first sites that differ.
    got_readouts = [ResidualReadout(r.positions[:end], {n: t[:end] for n, t in r.tensors.items()}, {})
                    for r, end in zip(readouts(got), ends, strict=True)]
    references = [r["tensors"] for r in want["readouts"]]
    report(f"{mode} vs eager", compare(got_readouts, references, LAYERS, rel_tol=SAME_MODEL_REL_TOL))
    assert got["sequences"] == want["sequences"], f"{mode}: greedy tokens differ from eager's"


@pytest.mark.parametrize("mode", ["eager", *OTHER_MODES])
def test_consumers_get_every_row(engines, mode):
    capture = with_eager(engines, mode)[mode]["capture"]
    assert capture["statuses"] == [{"inline": "ok", "filesystem": "ok"}] * len(PROMPT_LENGTHS), capture["messages"]
    root = engines.capture_root(mode)
    tags = [f"req-{i}" for i in range(len(PROMPT_LENGTHS))]
    # TP: rank 0 alone writes (no duplicates); PP: each stage writes its layers, read back merged.
    assert list_captures(root) == tags
    file_sites = [site_name(layer, hook) for hook, layers in FILE_SITES.items() for layer in layers]
    for tag, length, readout in zip(tags, PROMPT_LENGTHS, capture["readouts"], strict=True):
        # Every computed position: the prompt and every generated token but the last, never fed back.
        assert readout["positions"] == list(range(length + GREEDY["max_tokens"] - 1))
        assert len(readout["tensors"]) == LAYERS * len(HOOKS)
        tensors, _ = read_capture(root, tag)
        assert sorted(tensors) == sorted(file_sites)
        for name, tensor in tensors.items():
            assert torch.equal(tensor, readout["tensors"][name]), f"{mode} {tag} {name}: file != inline rows"
