"""The independent reference: transformers with forward hooks at the three sites of every layer.

Each site hands its hook the stream as a getter and a setter, so one mechanism both records the residual
stream (parity, capture) and edits it in place (steering adds a vector, patching overwrites rows); an edit
at a site is applied before the site is recorded, as vllm-interp's site op does. No vLLM code is used.
"""

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import transformers
from torch import nn

from vllm_interp.hooks import site_name

# The stream at one site, [tokens, hidden] -> the value the model carries on with.
SiteEdit = Callable[[torch.Tensor], torch.Tensor]
# Called at a site with get() -> [tokens, hidden] and set(new) (in place, so the rest of the layer sees it).
Visit = Callable[[Callable[[], torch.Tensor], Callable[[torch.Tensor], None]], None]
# Installs the post_attn site on one decoder layer (architectures differ in where that stream exists).
PostAttnSite = Callable[[nn.Module, Visit], list]


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    base = model.base_model
    return base.layers if hasattr(base, "layers") else base.h


def stream_arg(args: tuple, kwargs: dict) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


def visit_tensor(visit: Visit, batch: torch.Tensor) -> None:
    """Visit the first (only) sequence of a ``[1, tokens, hidden]`` tensor the model goes on using."""
    visit(lambda: batch[0], lambda new: batch[0].copy_(new))


@dataclass
class ReferenceRun:
    logits: torch.Tensor  # [tokens, vocab]
    sites: dict[str, torch.Tensor]  # site name -> [tokens, hidden], after any edit at that site

    def generated_logprobs(self, prompt_len: int, generated: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Logprob of each generated token (fed back from ``prompt_len`` on), and the best logprob at each of
        those positions (equal to the first for a greedy choice)."""
        rows = torch.arange(prompt_len - 1, prompt_len - 1 + len(generated))
        logprobs = torch.log_softmax(self.logits[rows], dim=-1)
        chosen = logprobs[torch.arange(len(generated)), torch.tensor(generated)]
        return chosen.numpy(), logprobs.amax(-1).numpy()


class HookedReference:
    """A transformers fp32 model whose three sites per layer can be read and edited."""

    def __init__(self, model_path: str | Path, post_attn: PostAttnSite) -> None:
        self.model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        self.layers = decoder_layers(self.model)
        self.post_attn = post_attn

    def run(self, sequence: list[int], edits: dict[str, SiteEdit] | None = None) -> ReferenceRun:
        edits = edits or {}
        sites: dict[str, torch.Tensor] = {}

        def visitor(name: str) -> Visit:
            def visit(get, set_) -> None:
                if name in edits:
                    set_(edits[name](get()))
                sites[name] = get().clone()
            return visit

        handles = []
        for index, layer in enumerate(self.layers):
            pre, mid, post = (visitor(site_name(index, hook)) for hook in ("pre_attn", "post_attn", "post_block"))
            handles.append(layer.register_forward_pre_hook(
                lambda _m, args, kwargs, v=pre: visit_tensor(v, stream_arg(args, kwargs)), with_kwargs=True))
            handles += self.post_attn(layer, mid)
            handles.append(layer.register_forward_hook(
                lambda _m, _a, out, v=post: visit_tensor(v, out[0] if isinstance(out, tuple) else out)))
        try:
            with torch.no_grad():
                out = self.model(torch.tensor([sequence]), output_hidden_states=True)
        finally:
            for handle in handles:
                handle.remove()
        for index in range(len(self.layers)):
            # hidden_states[L] is the stream entering layer L: the pre_attn hook must have seen that tensor.
            torch.testing.assert_close(out.hidden_states[index][0], sites[site_name(index, "pre_attn")])
        return ReferenceRun(out.logits[0].float(), sites)


def hf_residuals(model_path, sequences: list[list[int]], post_attn: PostAttnSite) -> list[dict[str, torch.Tensor]]:
    """For each token sequence, unedited: site name -> [tokens, hidden]."""
    reference = HookedReference(model_path, post_attn)
    return [reference.run(sequence).sites for sequence in sequences]


TIER_POSITIONS = {
    "base": lambda positions, prompt_len: positions >= 0,
    "prefill": lambda positions, prompt_len: positions < prompt_len,
    "decode": lambda positions, prompt_len: positions >= prompt_len,
}


def steering_edits(steering: dict[tuple[str, int, str], object], num_tokens: int,
                   prompt_len: int) -> dict[str, SiteEdit]:
    """Site edits adding ``steering`` ((tier, layer, hook) -> vector, already scaled) where each tier applies:
    base everywhere, prefill on the prompt, decode on the generated tokens fed back. Vectors of several tiers
    at one site add up."""
    positions = torch.arange(num_tokens)
    totals: dict[str, torch.Tensor] = {}
    for (tier, layer, hook), vector in steering.items():
        mask = TIER_POSITIONS[tier](positions, prompt_len).float()[:, None]
        added = mask * torch.as_tensor(np.asarray(vector), dtype=torch.float32)
        name = site_name(layer, hook)
        totals[name] = totals[name] + added if name in totals else added
    return {name: (lambda stream, a=added: stream + a) for name, added in totals.items()}


def steered_run(reference: HookedReference, prompt: list[int], generated: list[int],
                steering: dict[tuple[str, int, str], object]) -> ReferenceRun:
    """transformers on ``prompt`` and the generated tokens fed back (the last one never is), with
    ``steering`` added in place."""
    sequence = prompt + generated[:-1]
    return reference.run(sequence, steering_edits(steering, len(sequence), len(prompt)))
