"""LoRA adapters: what a request served under an adapter reads and steers is the residual stream of the model with
the adapter merged into its weights (transformers), and a request without one on the same engine reads the base
model's."""

import json

import torch
from safetensors.torch import save_file
from vllm import SamplingParams
from vllm.lora.request import LoRARequest

from tests.conftest import ENGINE_KWARGS, HIDDEN, PROMPTS, engine_in_this_process, shutdown, vector
from tests.parity import compare
from tests.reference import HookedReference, steered_run
from tests.zoo import _input_of
from vllm_interp import LLM, steered_params

RANK, ALPHA, LAYERS = 8, 16, 30
TARGETS = {"q_proj": HIDDEN, "v_proj": 192}  # SmolLM2's query and value projections' output widths
STEERING = {("base", 10, "post_block"): vector(5, norm=8.0)}


def _random_adapter(path) -> dict[tuple[int, str], torch.Tensor]:
    """A PEFT-format adapter on every layer's query and value projections; returns each weight's delta."""
    generator = torch.Generator().manual_seed(0)
    tensors, deltas = {}, {}
    for layer in range(LAYERS):
        for proj, width in TARGETS.items():
            name = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            a = tensors[f"{name}.lora_A.weight"] = torch.randn(RANK, HIDDEN, generator=generator) * 0.05
            b = tensors[f"{name}.lora_B.weight"] = torch.randn(width, RANK, generator=generator) * 0.05
            deltas[layer, proj] = b @ a * (ALPHA / RANK)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": ALPHA, "lora_dropout": 0.0,
        "target_modules": list(TARGETS), "bias": "none", "fan_in_fan_out": False}))
    return deltas


def test_rows_read_and_steered_under_an_adapter_are_the_merged_models(smollm2_path, smollm2_tokenizer, tmp_path,
                                                                       parity_table):
    deltas = _random_adapter(tmp_path)
    prompt = smollm2_tokenizer(PROMPTS[1]).input_ids
    params = steered_params(SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                            steering_vectors={"post_block": {"10": STEERING["base", 10, "post_block"]}})
    with engine_in_this_process():
        llm = LLM(str(smollm2_path), enable_steering=True, enable_lora=True, max_lora_rank=RANK,
                  enforce_eager=True, **ENGINE_KWARGS)
        try:
            adapted, base = (llm.generate([{"prompt_token_ids": prompt}], params, readout={"positions": "all"},
                                          lora_request=lora, use_tqdm=False)[0]
                             for lora in (LoRARequest("random", 1, str(tmp_path)), None))
        finally:
            shutdown(llm)
    reference = HookedReference(smollm2_path, _input_of("post_attention_layernorm"))
    expected_base = steered_run(reference, prompt, list(base.outputs[0].token_ids), STEERING)
    with torch.no_grad():
        for (layer, proj), delta in deltas.items():
            getattr(reference.layers[layer].self_attn, proj).weight += delta
    expected_adapted = steered_run(reference, prompt, list(adapted.outputs[0].token_ids), STEERING)
    # The adapter moves the stream far beyond round-off: the two requests must not pass for each other.
    assert (expected_adapted.sites["3.post_block"] - expected_base.sites["3.post_block"]).abs().max() > 1.0
    for name, readout, expected in (("adapter", adapted, expected_adapted), ("base", base, expected_base)):
        parity_table.append((f"smollm2 steered, LoRA engine, {name} request",
                             compare([readout.residuals], [expected.sites], num_layers=LAYERS)))
