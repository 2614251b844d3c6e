"""Reference residual streams from transformers, and the comparison against vllm-interp read-outs."""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import transformers
from vllm import SamplingParams

from vllm_interp.hooks import HOOKS, site_name

# fp32 on both sides; vLLM and transformers differ in kernel order (fused norms, attention, matmul
# blocking), so values agree to float32 round-off accumulated over the layers, relative to the size of the
# stream: |vllm - hf| <= REL_TOL * max|hf| for every site.
REL_TOL = 2e-5


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    base = model.base_model
    return base.layers if hasattr(base, "layers") else base.h


def hf_residuals(
    model_path, sequences: list[list[int]], post_attn_hook: Callable[[torch.nn.Module, list], None]
) -> list[dict[str, torch.Tensor]]:
    """For each token sequence: site name -> [tokens, hidden], read by transformers forward hooks."""
    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.eval()
    layers = decoder_layers(model)
    pre, post, mid = ([[] for _ in layers] for _ in range(3))
    for index, layer in enumerate(layers):
        layer.register_forward_pre_hook(
            lambda _m, args, kwargs, i=index: pre[i].append((args[0] if args else kwargs["hidden_states"])[0].clone()),
            with_kwargs=True,
        )
        layer.register_forward_hook(
            lambda _m, _a, out, i=index: post[i].append((out[0] if isinstance(out, tuple) else out)[0].clone())
        )
        post_attn_hook(layer, mid[index])
    results = []
    with torch.no_grad():
        for sequence in sequences:
            out = model(torch.tensor([sequence]), output_hidden_states=True)
            sites = {}
            for index in range(len(layers)):
                sites[site_name(index, "pre_attn")] = pre[index].pop()
                sites[site_name(index, "post_attn")] = mid[index].pop()
                sites[site_name(index, "post_block")] = post[index].pop()
                # output_hidden_states[L] is the stream entering layer L: the same tensor as the pre-hook.
                torch.testing.assert_close(out.hidden_states[index][0], sites[site_name(index, "pre_attn")])
            results.append(sites)
    return results


@dataclass
class ParityResult:
    sites_checked: int
    rows_checked: int
    max_abs_diff: float
    max_rel_diff: float  # max over sites of max|diff| / max|hf|


def engine_sequences_and_readouts(llm, prompts: list[list[int]], max_tokens: int):
    """Run all prompts as one continuous batch, reading every site at every computed position."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, readout={"positions": "all"},
                           use_tqdm=False)
    # The last generated token is sampled but never fed back, so it has no residual.
    sequences = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids)[:-1] for o in outputs]
    for sequence, output in zip(sequences, outputs, strict=True):
        assert output.residuals.positions == list(range(len(sequence)))
    return sequences, [o.residuals for o in outputs]


def compare(readouts, references, num_layers: int, rel_tol: float = REL_TOL) -> ParityResult:
    """Every site of every read-out against the reference rows at the read-out's positions."""
    worst, worst_rel, sites, rows = 0.0, 0.0, 0, 0
    failures = []
    for readout, reference in zip(readouts, references, strict=True):
        for layer in range(num_layers):
            for hook in HOOKS:
                name = site_name(layer, hook)
                got, want = readout[name], reference[name][readout.positions]
                assert got.shape == want.shape, f"{name}: {tuple(got.shape)} vs {tuple(want.shape)}"
                diff = (got - want).abs().max().item()
                rel = diff / max(want.abs().max().item(), 1e-6)
                if not rel <= rel_tol:
                    failures.append(f"{name}: max abs diff {diff:.3e} = {rel:.2e} of max|hf|")
                worst, worst_rel = max(worst, diff), max(worst_rel, rel)
                sites += 1
                rows += got.shape[0]
    assert not failures, f"{len(failures)} sites differ from transformers: " + "; ".join(failures[:10])
    return ParityResult(sites, rows, worst, worst_rel)
