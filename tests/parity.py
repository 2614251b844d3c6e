"""Comparing vllm-interp read-outs with the reference residual streams (tests/reference.py), row by row."""

from dataclasses import dataclass

import torch
from vllm import SamplingParams

from vllm_interp.hooks import HOOKS, site_name

# fp32 on both sides; vLLM and transformers differ in kernel order (fused norms, attention, matmul
# blocking), so values agree to float32 round-off accumulated over the layers, relative to the size of the
# row: |vllm - hf| <= REL_TOL * max|hf row| for every row (token position) of every site. Each row is held
# to its own scale: one large row (SmolLM2's first-token stream is ~100x the others) must not loosen the
# bound on the others, as a per-site scale did (2e-5 of the site's max was ~2e-3 of an ordinary row).
# Measured worst row on SmolLM2: 1.9e-5 (chunked-prefill batch); the bound leaves room for step
# composition, which moves round-off between runs.
REL_TOL = 4e-5


@dataclass
class ParityResult:
    sites_checked: int
    rows_checked: int
    max_abs_diff: float
    max_rel_diff: float  # max over rows of max|diff| / max|hf row|
    worst_row: str  # "site @ position" of max_rel_diff


def row_errors(got: torch.Tensor, want: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``[rows, hidden]``: the max abs difference, and that relative to the row's own max|want|."""
    diff = (got - want).abs().amax(dim=-1)
    return diff, diff / want.abs().amax(dim=-1).clamp_min(1e-6)


def assert_rows_close(got: torch.Tensor, want: torch.Tensor, what: str, rel_tol: float = REL_TOL) -> float:
    """Every row within ``rel_tol`` of its own scale; returns the worst relative difference."""
    assert got.shape == want.shape, f"{what}: {tuple(got.shape)} vs {tuple(want.shape)}"
    _, rel = row_errors(got, want)
    worst = int(rel.argmax())
    assert rel[worst] <= rel_tol, f"{what}: row {worst} differs by {rel[worst]:.2e} of its max|hf|"
    return float(rel[worst])


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
    """Every row of every site of every read-out against the reference row at the same position."""
    worst_abs, worst_rel, worst_row, sites, rows = 0.0, 0.0, "", 0, 0
    failures = []
    for readout, reference in zip(readouts, references, strict=True):
        for layer in range(num_layers):
            for hook in HOOKS:
                name = site_name(layer, hook)
                got, want = readout[name], reference[name][readout.positions]
                assert got.shape == want.shape, f"{name}: {tuple(got.shape)} vs {tuple(want.shape)}"
                diff, rel = row_errors(got, want)
                row = int(rel.argmax())
                where = f"{name} @ position {readout.positions[row]}"
                if not rel[row] <= rel_tol:
                    bad = int((rel > rel_tol).sum())
                    failures.append(f"{where}: {diff[row]:.3e} = {rel[row]:.2e} of its row's max|hf| ({bad} rows)")
                if rel[row] > worst_rel:
                    worst_rel, worst_row = float(rel[row]), where
                worst_abs = max(worst_abs, float(diff.max()))
                sites += 1
                rows += got.shape[0]
    assert not failures, f"{len(failures)} sites differ from transformers: " + "; ".join(failures[:10])
    return ParityResult(sites, rows, worst_abs, worst_rel, worst_row)
