"""Supported architectures and where each exposes the residual stream; ``install_sites`` hooks a model.

Keys are the vLLM model class that is actually loaded (``type(model).__name__``), so models that vLLM
serves through its Transformers backend (OLMo2 in 0.26, or any causal LM with ``model_impl="transformers"``)
are covered by the ``TransformersForCausalLM`` entry.
"""

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from operator import attrgetter
from typing import Literal

import torch
from torch import nn

from vllm_interp.hooks import HOOKS
from vllm_interp.models import hook_points, site_ops
from vllm_interp.models.gpt_neox import gpt_neox_layer_forward


class UnsupportedArchitecture(RuntimeError):
    pass


def _transformers_post_attn(layer: nn.Module) -> str:
    """Which child of a transformers decoder layer receives the post-attention stream."""
    if hasattr(layer, "pre_feedforward_layernorm"):  # Gemma-style sandwich norms
        return "pre_feedforward_layernorm"
    if hasattr(layer, "post_feedforward_layernorm"):  # OLMo2-style post-norm: the MLP reads the stream
        return "mlp"
    if hasattr(layer, "post_attention_layernorm"):  # Llama-style pre-norm
        return "post_attention_layernorm"
    raise UnsupportedArchitecture(
        f"transformers layer {type(layer).__name__} has no recognised pre-MLP norm "
        "(pre_feedforward_layernorm, post_feedforward_layernorm + mlp, post_attention_layernorm)"
    )


@dataclass(frozen=True)
class ArchSites:
    """Where one architecture's sites live on the loaded vLLM model."""

    layers: str  # dotted path of the decoder-layer ModuleList
    # "pair": layer(positions, hidden, residual) -> (hidden, residual), stream = hidden + residual;
    # "single": the layer takes the stream as argument `hidden_arg` and returns it.
    form: Literal["pair", "single"] = "pair"
    hidden_arg: int = 0
    # The child whose input is the post_attn stream (its name, or a function of the layer).
    post_attn: str | Callable[[nn.Module], str] | None = "post_attention_layernorm"
    # A replacement forward that reads all three sites itself (blocks with no post_attn module).
    forward: Callable | None = None

    def install(self, layer: nn.Module, buffers: hook_points.LayerBuffers) -> None:
        buffers.attach(layer)
        if self.forward is not None:
            hook_points.swap_class(layer, lambda base: hook_points.with_forward(base, self.forward))
            return
        if self.form == "pair":
            hook_points.swap_class(layer, hook_points.pair_layer)
        else:
            hook_points.swap_class(layer, lambda base: hook_points.single_layer(base, self.hidden_arg))
        name = self.post_attn(layer) if callable(self.post_attn) else self.post_attn
        target = getattr(layer, name)
        buffers.attach(target)
        hook_points.swap_class(target, hook_points.post_attn_input)


_LLAMA_LIKE = ArchSites(layers="model.layers")
_GEMMA = ArchSites(layers="model.layers", post_attn="pre_feedforward_layernorm")

SUPPORTED_ARCHITECTURES: dict[str, ArchSites] = {
    "LlamaForCausalLM": _LLAMA_LIKE,
    "MistralForCausalLM": _LLAMA_LIKE,
    "Qwen2ForCausalLM": _LLAMA_LIKE,
    "Qwen3ForCausalLM": _LLAMA_LIKE,
    "Phi3ForCausalLM": _LLAMA_LIKE,
    "MixtralForCausalLM": _LLAMA_LIKE,
    "Qwen2MoeForCausalLM": _LLAMA_LIKE,
    "Qwen3MoeForCausalLM": _LLAMA_LIKE,
    "Gemma2ForCausalLM": _GEMMA,
    "Gemma3ForCausalLM": _GEMMA,
    "GPT2LMHeadModel": ArchSites(layers="transformer.h", form="single", post_attn="ln_2"),
    "GPTNeoXForCausalLM": ArchSites(layers="gpt_neox.layers", forward=gpt_neox_layer_forward),
    "TransformersForCausalLM": ArchSites(layers="model.layers", form="single", post_attn=_transformers_post_attn),
}
# Hugging Face architectures that vLLM 0.26 serves through its Transformers backend.
TRANSFORMERS_BACKEND_ARCHITECTURES = ("Olmo2ForCausalLM",)
# How Hugging Face names a decoder-only model with a language-model head (GPT2LMHeadModel is the older form).
CAUSAL_LM_SUFFIXES = ("ForCausalLM", "LMHeadModel")


def supported_architectures() -> list[str]:
    return sorted(set(SUPPORTED_ARCHITECTURES) - {"TransformersForCausalLM"} | set(TRANSFORMERS_BACKEND_ARCHITECTURES))


def unsupported_message(architecture: str) -> str:
    return (
        f"vllm-interp cannot hook architecture {architecture!r}. Supported: "
        f"{', '.join(supported_architectures())}; any other decoder-only causal LM (an architecture named "
        "*ForCausalLM or *LMHeadModel) through vLLM's Transformers backend (model_impl='transformers') whose "
        "layers have a recognised pre-MLP norm. Encoders, encoder-decoders, pooling and multimodal models are "
        "not supported."
    )


def check_architecture(architectures: list[str], model_impl: str = "auto") -> None:
    """Start-up check on the Hugging Face config, before an engine is built."""
    known = set(SUPPORTED_ARCHITECTURES) | set(TRANSFORMERS_BACKEND_ARCHITECTURES)
    for architecture in architectures:
        # The Transformers backend loads any Hugging Face model, encoders and pooling heads included; the
        # sites are defined on decoder layers only, which Hugging Face names by their causal-LM head.
        through_backend = model_impl == "transformers" and architecture.endswith(CAUSAL_LM_SUFFIXES)
        if architecture not in known and not through_backend:
            raise UnsupportedArchitecture(unsupported_message(architecture))


@dataclass
class SiteBank:
    """The buffers behind the installed sites of one model replica (one worker)."""

    layers: list[int]  # decoder layers this rank holds
    steer_index: torch.Tensor  # [max_tokens] steering-table row of each token
    # [len(layers), len(HOOKS), steer_rows, hidden] steering vectors of each held layer (in ``layers`` order;
    # each layer's sites see their own slice), one tensor so that a table row is written in one copy.
    steer_table: torch.Tensor
    # [len(layers), len(HOOKS), max_tokens] patch slot of each token per held layer (in ``layers`` order);
    # each layer's sites see their own slice.
    patch_index: torch.Tensor
    patch_values: torch.Tensor  # [patch_slots, hidden] slot 0 unused
    patch_alpha: torch.Tensor  # [patch_slots]
    # What CUDA-graph replays read (see site_ops): token row -> read slot ([max_tokens], -1: not read), which
    # held layer's hooks are read ([len(layers), len(HOOKS)]), and where to ([len(layers), len(HOOKS),
    # graph_read_rows, hidden]; zero rows: graphs never read, steps that read run eagerly).
    read_slot: torch.Tensor
    read_flags: torch.Tensor
    read_out: torch.Tensor

    @property
    def graph_read_rows(self) -> int:
        return self.read_out.shape[2]

    @property
    def residual(self) -> tuple[int, torch.dtype, torch.device]:
        """The residual stream's width, dtype and device, which every buffer of rows here shares."""
        return self.read_out.shape[-1], self.read_out.dtype, self.read_out.device

    @cached_property
    def layer_index(self) -> dict[int, int]:
        """Held layer -> its index in the per-layer buffers (layers other stages hold are absent)."""
        return {layer: i for i, layer in enumerate(self.layers)}

    def descriptor(self) -> dict[str, object]:
        return {"layers": self.layers, "hooks": list(HOOKS)}

    @classmethod
    def allocate(cls, held: list[int], *, hidden_size: int, dtype: torch.dtype, device: torch.device,
                 max_tokens: int, steer_rows: int, patch_slots: int, graph_read_rows: int) -> "SiteBank":
        """Zeroed buffers for the held layers (the sizes as ``install_sites`` describes them)."""
        # Patching off: one-token index rows suffice (the op never reads them).
        index_width = max_tokens if patch_slots > 1 else 1
        return cls(
            layers=held,
            steer_index=torch.zeros(max_tokens, dtype=torch.long, device=device),
            steer_table=torch.zeros(len(held), len(HOOKS), steer_rows, hidden_size, dtype=dtype, device=device),
            patch_index=torch.zeros(len(held), len(HOOKS), index_width, dtype=torch.long, device=device),
            patch_values=torch.zeros(patch_slots, hidden_size, dtype=dtype, device=device),
            patch_alpha=torch.zeros(patch_slots, dtype=dtype, device=device),
            read_slot=torch.full((max_tokens if graph_read_rows else 1,), -1, dtype=torch.long, device=device),
            read_flags=torch.zeros(len(held), len(HOOKS), dtype=torch.int32, device=device),
            read_out=torch.zeros(len(held), len(HOOKS), graph_read_rows, hidden_size, dtype=dtype, device=device),
        )


def install_sites(
    model: nn.Module,
    *,
    hidden_size: int,
    dtype: torch.dtype,
    device: torch.device,
    max_tokens: int,
    steer_rows: int,
    patch_slots: int,
    graph_read_rows: int,
    is_held: Callable[[nn.Module], bool],
) -> SiteBank:
    """Install the three sites on every decoder layer this rank holds (``is_held``: not a placeholder for
    a layer another pipeline stage holds); returns their buffers.

    ``steer_rows`` is the height of each layer's steering table (1: steering off, only the zero row);
    ``patch_slots`` that of the patch value table (1: patching off); ``graph_read_rows`` the rows a CUDA-graph
    replay can read (0: steps that read run eagerly).
    """
    architecture = type(model).__name__
    sites = SUPPORTED_ARCHITECTURES.get(architecture)
    if sites is None:
        raise UnsupportedArchitecture(unsupported_message(architecture))
    layers = attrgetter(sites.layers)(model)
    held = [index for index, layer in enumerate(layers) if is_held(layer)]
    if not held:
        raise UnsupportedArchitecture(f"{architecture}: found no decoder layers at {sites.layers!r}")
    bank = SiteBank.allocate(held, hidden_size=hidden_size, dtype=dtype, device=device, max_tokens=max_tokens,
                             steer_rows=steer_rows, patch_slots=patch_slots, graph_read_rows=graph_read_rows)
    for position, index in enumerate(held):
        buffers = hook_points.LayerBuffers(
            layer=index,
            steer_index=bank.steer_index,
            steer_table=bank.steer_table[position],
            patch_index=bank.patch_index[position],
            patch_values=bank.patch_values,
            patch_alpha=bank.patch_alpha,
            read_slot=bank.read_slot,
            read_flags=bank.read_flags[position],
            read_out=bank.read_out[position],
        )
        sites.install(layers[index], buffers)
    site_ops.warm_eager_steering(bank.steer_index, bank.steer_table)
    return bank
