"""Hook points: class swaps that call the read op at the three residual-stream sites of a layer.

Hooks are installed by swapping ``module.__class__`` for a subclass (not by wrapping modules), so
parameter names, weight loading and vLLM's CustomOp dispatch are unchanged. Every hooked module holds its
layer's index and the site op's buffers as non-persistent buffers (see ``LayerBuffers``): the step's
steering index and the patch value table (shared by all layers), and the layer's steering table and patch
index (shared by the layer and its post_attn module), and the rows a CUDA-graph replay reads: the token row ->
read slot map (shared), the layer's per-hook read flags and read buffer.
"""

from collections.abc import Callable
from dataclasses import dataclass, fields
from functools import cache

import torch
from torch import nn

from vllm_interp.hooks import POST_ATTN, POST_BLOCK, PRE_ATTN
from vllm_interp.models.site_ops import site


@dataclass(frozen=True)
class LayerBuffers:
    layer: int  # the decoder layer's index in the whole model (not within a pipeline stage)
    steer_index: torch.Tensor  # [max_tokens] steering-table row per token (shared)
    steer_table: torch.Tensor  # [hooks, rows, hidden] this layer's steering vectors
    patch_index: torch.Tensor  # [hooks, max_tokens] this layer's patch slot per token (0: not patched)
    patch_values: torch.Tensor  # [slots, hidden] the step's patch sources (shared)
    patch_alpha: torch.Tensor  # [slots] their interpolation weights (shared)
    read_slot: torch.Tensor  # [max_tokens] read slot of each token row in a graph replay, -1: none (shared)
    read_flags: torch.Tensor  # [hooks] whether a graph replay reads this layer's hook
    read_out: torch.Tensor  # [hooks, graph read rows, hidden] where a graph replay reads to

    def attach(self, module: nn.Module) -> None:
        module.interp_layer = self.layer
        for buffer in fields(self):
            if buffer.name != "layer":
                module.register_buffer(f"interp_{buffer.name}", getattr(self, buffer.name), persistent=False)


def visit(module: nn.Module, hidden: torch.Tensor, residual: torch.Tensor | None, hook: int,
          hidden_in_use: bool = False) -> None:
    """Run the site op on the stream at ``hook`` of the layer ``module`` belongs to (``hidden_in_use``: the
    layer reads ``hidden`` again after this site, so a patch must leave it as it is)."""
    site(hidden, residual, module.interp_steer_index, module.interp_steer_table, module.interp_patch_index,
         module.interp_patch_values, module.interp_patch_alpha, module.interp_read_slot, module.interp_read_flags,
         module.interp_read_out, module.interp_layer, hook, hidden_in_use)


def swap_class(module: nn.Module, make: Callable[[type], type]) -> None:
    # vLLM's Transformers backend binds fused forwards on instances (``module.forward = MethodType(...)``
    # in its fusers), which would shadow the class-level hook; keep such a forward as the inner call.
    instance_forward = module.__dict__.pop("forward", None)
    module.__class__ = make(type(module))
    if instance_forward is not None:
        module.interp_inner_forward = instance_forward


def _inner(module: nn.Module, base: type, *args, **kwargs):
    """The forward the hook wraps: an instance-bound one if the module had it, else the class's."""
    inner = getattr(module, "interp_inner_forward", None)
    return inner(*args, **kwargs) if inner is not None else base.forward(module, *args, **kwargs)


@cache
def pair_layer(base: type) -> type:
    """A layer called as ``(positions, hidden_states, residual)`` returning the deferred pair.

    The true stream is ``hidden_states + residual`` (residual is None on the first layer).
    """

    def forward(self, positions, hidden_states, residual, *args, **kwargs):
        visit(self, hidden_states, residual, PRE_ATTN)
        hidden_states, residual = _inner(self, base, positions, hidden_states, residual, *args, **kwargs)
        visit(self, hidden_states, residual, POST_BLOCK)
        return hidden_states, residual

    return type(f"Interp{base.__name__}", (base,), {"forward": forward})


@cache
def single_layer(base: type, hidden_arg: int) -> type:
    """A layer that takes the stream as positional argument ``hidden_arg`` and returns the new stream
    (or a tuple whose first element is it, as some transformers layers do)."""

    def forward(self, *args, **kwargs):
        hidden = args[hidden_arg] if len(args) > hidden_arg else kwargs["hidden_states"]
        visit(self, hidden, None, PRE_ATTN)
        output = _inner(self, base, *args, **kwargs)
        stream = output[0] if isinstance(output, tuple) else output
        visit(self, stream, None, POST_BLOCK)
        return output

    return type(f"Interp{base.__name__}", (base,), {"forward": forward})


@cache
def post_attn_input(base: type) -> type:
    """The module that receives the post-attention stream: a pre-MLP norm called as ``(x)`` or as the fused
    ``(x, residual)`` (stream = x + residual), or the MLP itself in post-norm blocks."""

    def forward(self, x, *args, **kwargs):
        residual = args[0] if args else kwargs.get("residual")
        visit(self, x, residual, POST_ATTN)
        return _inner(self, base, x, *args, **kwargs)

    return type(f"Interp{base.__name__}", (base,), {"forward": forward})


@cache
def with_forward(base: type, forward: Callable) -> type:
    """A layer whose forward is replaced by one that calls the three sites itself."""
    return type(f"Interp{base.__name__}", (base,), {"forward": forward})
