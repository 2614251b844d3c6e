"""transformers with steering vectors added by forward hooks: the reference for steered logprobs."""

import torch
import transformers

from tests.parity import decoder_layers


def _add(tensor: torch.Tensor, vector: torch.Tensor, mask: torch.Tensor) -> None:
    tensor[0, mask] += vector


def load_reference(model_path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


def hf_steered_logprobs(model, prompt: list[int], generated: list[int], steering: dict, prompt_len: int):
    """Logprob of each generated token under transformers with ``steering`` added in place.

    ``steering`` maps (tier, layer, hook) -> vector; tier picks the positions: base all, prefill the
    prompt, decode the generated tokens (fed back from position ``prompt_len`` on).
    """
    layers = decoder_layers(model)
    handles = []
    sequence = prompt + generated[:-1]
    positions = torch.arange(len(sequence))
    masks = {"base": positions >= 0, "prefill": positions < prompt_len, "decode": positions >= prompt_len}
    for (tier, layer, hook), vector in steering.items():
        vector, mask = torch.as_tensor(vector, dtype=torch.float32), masks[tier]
        module = layers[layer]
        if hook == "pre_attn":
            handles.append(module.register_forward_pre_hook(lambda _m, args, kwargs, v=vector, m=mask: _add(
                args[0] if args else kwargs["hidden_states"], v, m), with_kwargs=True))
        elif hook == "post_attn":
            # In place on the norm's input, which is also the tensor the layer keeps as its residual.
            handles.append(module.post_attention_layernorm.register_forward_pre_hook(
                lambda _m, args, v=vector, m=mask: _add(args[0], v, m)))
        else:
            handles.append(module.register_forward_hook(lambda _m, _a, out, v=vector, m=mask: _add(
                out[0] if isinstance(out, tuple) else out, v, m)))
    try:
        with torch.no_grad():
            logits = model(torch.tensor([sequence])).logits[0].float()
    finally:
        for handle in handles:
            handle.remove()
    logprobs = torch.log_softmax(logits, dim=-1)
    rows = torch.arange(prompt_len - 1, len(sequence))
    return logprobs[rows, torch.tensor(generated)], logits[rows].argmax(-1)
