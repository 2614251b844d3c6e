"""What the steering engine tests share: greedy params, reading outputs, and grading a steered output (its
logprobs and any rows it read) against the hooked transformers reference."""

import numpy as np
from vllm import SamplingParams

from tests.parity import assert_rows_close
from tests.reference import HookedReference, steered_run

MAX_TOKENS = 8
# vLLM and transformers agree to ~2e-5 in logprobs on the unsteered model (fp32); steering adds no error.
LOGPROB_TOL = 1e-4
# The frontend submits a batch's requests one by one and the engine-core process may start stepping before
# the last arrives, so two runs of the same batch can differ in step composition and hence in kernel
# round-off, and a request beside others that are patched or steered runs in steps shaped by their outputs.
# Seen: 2e-7, and up to 1.4e-5 on an AVX2-only CPU (AMD EPYC, no AVX-512), whose fp32 kernels round
# differently per batch shape. Equal tokens and logprobs within this bound is "unchanged"; steering moves
# them by more than 1e-2.
ROUND_OFF = 3e-5

Steering = dict[tuple[str, int, str], object]  # (tier, layer, hook) -> vector, scale applied


def greedy(max_tokens: int = MAX_TOKENS, logprobs: int | None = 1) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)


def tokens_and_logprobs(output) -> tuple[list[int], list[float]]:
    completion = output.outputs[0]
    tokens = list(completion.token_ids)
    return tokens, [completion.logprobs[i][t].logprob for i, t in enumerate(tokens)]


def moved(a, b) -> float:
    """How far steering moved an output: a token change counts as 1, else the max logprob change."""
    return 1.0 if a[0] != b[0] else float(np.max(np.abs(np.asarray(a[1]) - np.asarray(b[1]))))


def assert_same_output(a, b) -> None:
    assert a[0] == b[0], "greedy tokens differ"
    diff = max((abs(x - y) for x, y in zip(a[1], b[1], strict=True)), default=0.0)
    assert diff < ROUND_OFF, f"logprobs differ by {diff:.2e}"


def as_steering(tier: str, spec: dict) -> Steering:
    """A request or global spec of one tier ({hook: {layer: vector | {vector, scale}}}) as reference steering."""
    steering: Steering = {}
    for hook, layers in spec.items():
        for layer, entry in layers.items():
            vector, scale = (entry["vector"], entry.get("scale", 1.0)) if isinstance(entry, dict) else (entry, 1.0)
            steering[(tier, int(layer), hook)] = np.asarray(vector, dtype=np.float32) * scale
    return steering


def assert_matches_reference(reference: HookedReference, output, steering: Steering, what: str = "") -> float:
    """The output's logprobs (and rows, if it read any) equal transformers steered the same way; every greedy
    choice is the reference's best token (within the tolerance: near-ties may pick either). Returns the max
    logprob difference."""
    prompt = list(output.prompt_token_ids)
    tokens, logprobs = tokens_and_logprobs(output)
    run = steered_run(reference, prompt, tokens, steering)
    chosen, best = run.generated_logprobs(len(prompt), tokens)
    diff = float(np.max(np.abs(np.asarray(logprobs) - chosen)))
    assert diff <= LOGPROB_TOL, f"{what}: max logprob diff from transformers {diff:.2e}"
    assert np.all(chosen >= best - LOGPROB_TOL), f"{what}: a greedy token is not transformers' best"
    residuals = getattr(output, "residuals", None)
    if residuals is not None:
        for name, rows in residuals.tensors.items():
            assert_rows_close(rows, run.sites[name][residuals.positions], f"{what} {name}")
    return diff
