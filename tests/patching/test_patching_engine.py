"""Patching on the real SmolLM2 engine: cells covering every layer, position and hook (pre_attn, post_block)
of the grid equal an independent transformers forward-hook reference; the limiting cases (everything patched,
a self-patch, alpha) behave as they must; patched requests leave unpatched ones in their batch untouched; a
patch that cannot be applied fails its request."""

import numpy as np
import pytest
import torch
from vllm import SamplingParams

from tests.steering.common import assert_same_output, greedy, tokens_and_logprobs
from vllm_interp import patched_params
from vllm_interp.hooks import site_name
from vllm_interp.llm import PatchFailed
from vllm_interp.patching.spec import PatchError

LAYERS = 30
HOOKS = ("pre_attn", "post_block")
# Clean and corrupt prompts of equal token length, the clean answer and the corrupt one (the foil).
PAIRS = [
    ("The Eiffel Tower is located in the city of", "The Colosseum is located in the city of", " Paris", " Rome"),
    ("The capital of France is", "The capital of Italy is", " Paris", " Rome"),
]
LOGPROB_TOL = 1e-4


def _grade(answer: int, foil: int) -> SamplingParams:
    """One generated token, graded by the exact logprobs of the answer and foil ids (full vocabulary)."""
    return SamplingParams(temperature=0.0, max_tokens=1, logprob_token_ids=[answer, foil])


def _answer_foil(output, answer: int, foil: int) -> tuple[float, float]:
    logprobs = output.outputs[0].logprobs[0]
    return logprobs[answer].logprob, logprobs[foil].logprob


def _reference_answer_foil(reference, sequence, edits, answer, foil) -> tuple[float, float]:
    logprobs = torch.log_softmax(reference.run(sequence, edits).logits[-1], dim=-1)
    return float(logprobs[answer]), float(logprobs[foil])


def _replace_row(position: int, value: torch.Tensor, alpha: float = 1.0):
    def edit(stream: torch.Tensor) -> torch.Tensor:
        out = stream.clone()
        out[position] = torch.lerp(stream[position], value, alpha)
        return out
    return edit


@pytest.fixture(scope="module")
def pairs(smollm2_llm, smollm2_tokenizer):
    """Each pair's token ids, answer and foil ids, and its clean run stored as a patch source."""
    prepared = []
    for i, (clean, corrupt, answer, foil) in enumerate(PAIRS):
        clean_ids, corrupt_ids = smollm2_tokenizer(clean).input_ids, smollm2_tokenizer(corrupt).input_ids
        assert len(clean_ids) == len(corrupt_ids)
        (answer_id,), (foil_id,) = smollm2_tokenizer(answer).input_ids, smollm2_tokenizer(foil).input_ids
        run = f"clean-{i}"
        (out,) = smollm2_llm.generate([{"prompt_token_ids": clean_ids}], _grade(answer_id, foil_id), use_tqdm=False,
                                      capture={"patch_source": {"hooks": "all", "positions": "all_prompt", "tag": run}})
        assert out.capture["patch_source"].status == "ok", out.capture["patch_source"].message
        prepared.append(dict(clean=clean_ids, corrupt=corrupt_ids, answer=answer_id, foil=foil_id, run=run,
                             clean_logprobs=_answer_foil(out, answer_id, foil_id)))
    return prepared


def _cell(layer: int, hook: str, position: int, source: dict, alpha: float = 1.0) -> dict:
    return {"layer": layer, "hook": hook, "position": position, "alpha": alpha, "source": source}


def _grid_cells(n: int) -> list[tuple[int, str, int]]:
    """Cells of a layers x positions grid of ``n`` positions, at each hook, covering every layer and every
    position: a diagonal (each layer at one position, the positions in turn), and every position at the first,
    a middle and the last layer. The whole grid (900 cells for the two pairs, a transformers forward each) took
    275 s of a CI run for what these 198 cover: a cell's path is the same at every layer and position."""
    return sorted({(layer, hook, layer % n) for hook in HOOKS for layer in range(LAYERS)}
                  | {(layer, hook, p) for hook in HOOKS for layer in (0, LAYERS // 2, LAYERS - 1) for p in range(n)})


def test_cells_covering_every_layer_position_and_hook_equal_transformers(smollm2_llm, smollm2_reference, pairs):
    worst, count = 0.0, 0
    for pair in pairs:
        cells = _grid_cells(len(pair["corrupt"]))
        count += len(cells)
        params = [patched_params(_grade(pair["answer"], pair["foil"]),
                                 patch=[_cell(layer, hook, p, {"run": pair["run"], "position": p})])
                  for layer, hook, p in cells]
        outputs = smollm2_llm.generate([{"prompt_token_ids": pair["corrupt"]}] * len(cells), params, use_tqdm=False)
        clean_sites = smollm2_reference.run(pair["clean"]).sites
        for (layer, hook, p), output in zip(cells, outputs, strict=True):
            assert output.patch.status == "ok"
            name = site_name(layer, hook)
            want = _reference_answer_foil(smollm2_reference, pair["corrupt"],
                                          {name: _replace_row(p, clean_sites[name][p])}, pair["answer"], pair["foil"])
            diff = float(np.max(np.abs(np.subtract(_answer_foil(output, pair["answer"], pair["foil"]), want))))
            assert diff <= LOGPROB_TOL, f"{name} position {p}: answer/foil logprobs differ by {diff:.2e}"
            worst = max(worst, diff)
    print(f"\npatched cells vs transformers: {count} cells, max answer/foil logprob diff {worst:.2e}")


def test_limiting_cases_reproduce_the_clean_and_corrupt_runs(smollm2_llm, pairs):
    pair = pairs[0]
    n, grade = len(pair["corrupt"]), _grade(pair["answer"], pair["foil"])
    corrupt = [{"prompt_token_ids": pair["corrupt"]}]
    (plain,) = smollm2_llm.generate(corrupt, grade, use_tqdm=False)
    corrupt_logprobs = _answer_foil(plain, pair["answer"], pair["foil"])
    # Every position at layer 0's pre_attn: the corrupt prompt's stream is the clean one from the start.
    everything = [_cell(0, "pre_attn", p, {"run": pair["run"], "position": p}) for p in range(n)]
    (out,) = smollm2_llm.generate(corrupt, patched_params(grade, patch=everything), use_tqdm=False)
    np.testing.assert_allclose(_answer_foil(out, pair["answer"], pair["foil"]), pair["clean_logprobs"], atol=1e-5)
    # A self-patch (the corrupt run as its own source) changes nothing.
    smollm2_llm.generate(corrupt, grade, use_tqdm=False,
                         capture={"patch_source": {"hooks": {"post_block": [12]}, "positions": "all_prompt",
                                                   "tag": "corrupt-0"}})
    self_patch = [_cell(12, "post_block", p, {"run": "corrupt-0", "position": p}) for p in range(n)]
    (out,) = smollm2_llm.generate(corrupt, patched_params(grade, patch=self_patch), use_tqdm=False)
    np.testing.assert_allclose(_answer_foil(out, pair["answer"], pair["foil"]), corrupt_logprobs, atol=1e-5)
    # Alpha moves the answer's logprob monotonically from the corrupt run's to the clean run's, at the cell
    # that matters most here (the subject's last token, early layers).
    answers = []
    for alpha in (0.0, 0.5, 1.0):
        cell = [_cell(4, "post_block", 3, {"run": pair["run"], "position": 3}, alpha)]
        (out,) = smollm2_llm.generate(corrupt, patched_params(grade, patch=cell), use_tqdm=False)
        answers.append(_answer_foil(out, pair["answer"], pair["foil"])[0])
    assert answers[0] == pytest.approx(corrupt_logprobs[0], abs=1e-5)
    assert answers[0] < answers[1] < answers[2], answers


def test_patched_and_unpatched_requests_in_one_batch(smollm2_llm, plain_llm, prompt_ids):
    prompts = [{"prompt_token_ids": p} for p in prompt_ids]
    patch = [_cell(5, "post_block", 2, {"zeros": True}), _cell(9, "pre_attn", 0, {"vector": [1.0] * 576})]
    params = [patched_params(greedy(), patch=patch), greedy(), patched_params(greedy(), patch=patch), greedy()]
    mixed = smollm2_llm.generate(prompts, params, use_tqdm=False)
    baseline = plain_llm.generate(prompts, greedy(), use_tqdm=False)
    for i in (1, 3):
        assert_same_output(tokens_and_logprobs(mixed[i]), tokens_and_logprobs(baseline[i]))
    assert tokens_and_logprobs(mixed[0]) != tokens_and_logprobs(baseline[0])
    # The same prompts unpatched afterwards: no KV computed under the patch is reused.
    after = smollm2_llm.generate(prompts, greedy(), use_tqdm=False)
    for ours, theirs in zip(after, baseline, strict=True):
        assert_same_output(tokens_and_logprobs(ours), tokens_and_logprobs(theirs))


def test_a_patch_that_cannot_be_applied_fails_its_request(smollm2_llm, pairs):
    pair = pairs[1]
    corrupt = [{"prompt_token_ids": pair["corrupt"]}]
    with pytest.raises(PatchError, match=r"patch\.0\.source\.run: unknown source run 'nosuch'"):
        smollm2_llm.generate(corrupt, patched_params(greedy(), patch=[_cell(1, "pre_attn", 0, {"run": "nosuch",
                                                                                              "position": 0})]))
    beyond = len(pair["corrupt"])
    with pytest.raises(PatchFailed, match=f"position {beyond} is not a prompt position"):
        smollm2_llm.generate(corrupt, patched_params(greedy(), patch=[_cell(1, "pre_attn", beyond, {"zeros": True})]),
                             use_tqdm=False)
    with pytest.raises(PatchFailed, match=f"holds no 1.pre_attn at position {beyond}"):
        smollm2_llm.generate(corrupt, patched_params(greedy(), patch=[
            _cell(1, "pre_attn", 0, {"run": pair["run"], "position": beyond})]), use_tqdm=False)
    sources = smollm2_llm.patch_sources()
    assert pair["run"] in sources and sources[pair["run"]]["positions"] == list(range(len(pair["clean"])))
    assert smollm2_llm.delete_patch_source(pair["run"])
    with pytest.raises(PatchError, match="unknown source run"):
        smollm2_llm.generate(corrupt, patched_params(greedy(), patch=[_cell(1, "pre_attn", 0, {"run": pair["run"],
                                                                                              "position": 0})]))
