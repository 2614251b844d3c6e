"""The one naming scheme for residual-stream hook sites, used by every subsystem.

A site is ``(layer, hook)``; its name is ``"{layer}.{hook}"`` (e.g. ``"12.post_block"``).

- ``pre_attn``: the stream entering decoder layer ``layer``.
- ``post_attn``: the stream after the attention block's residual add, before the MLP.
- ``post_block``: the stream leaving the layer (before the final norm for the last layer);
  equal to ``pre_attn`` of ``layer + 1``.

TransformerLens names the same sites ``blocks.{layer}.hook_resid_pre`` / ``hook_resid_mid`` /
``hook_resid_post``. Every spec that names a hook or a site accepts either spelling (``canonical_hook``,
``parse_site_name``); capture can name its tensors either way (``site_name(..., naming=...)``).
"""

import re
from dataclasses import dataclass
from typing import Literal

Hook = Literal["pre_attn", "post_attn", "post_block"]
HOOKS: tuple[Hook, ...] = ("pre_attn", "post_attn", "post_block")
HOOK_INDEX: dict[str, int] = {hook: i for i, hook in enumerate(HOOKS)}
PRE_ATTN, POST_ATTN, POST_BLOCK = (HOOK_INDEX[hook] for hook in HOOKS)  # the sites' hook indices


@dataclass(frozen=True)
class ModelShape:
    """The grid of sites a model has (``num_layers`` x ``HOOKS``) and their width, as the engine reports them:
    every subsystem checks specs against it."""

    num_layers: int
    hidden_size: int


Naming = Literal["vllm_interp", "transformer_lens"]
NAMINGS: tuple[Naming, ...] = ("vllm_interp", "transformer_lens")
TRANSFORMER_LENS_HOOKS: dict[str, Hook] = {
    "hook_resid_pre": "pre_attn",
    "hook_resid_mid": "post_attn",
    "hook_resid_post": "post_block",
}
_TRANSFORMER_LENS_NAME = {hook: name for name, hook in TRANSFORMER_LENS_HOOKS.items()}
_TRANSFORMER_LENS_SITE = re.compile(r"blocks\.(\d+)\.(hook_resid_(?:pre|mid|post))")
HOOK_SPELLINGS = (*HOOKS, *TRANSFORMER_LENS_HOOKS)


def canonical_hook(name: object) -> Hook | None:
    """``pre_attn`` for ``pre_attn`` or ``hook_resid_pre`` (and so on); None for anything else."""
    if not isinstance(name, str):
        return None
    if name in HOOK_INDEX:
        return name  # type: ignore[return-value]
    return TRANSFORMER_LENS_HOOKS.get(name)


def site_name(layer: int, hook: str, naming: Naming = "vllm_interp") -> str:
    if naming == "transformer_lens":
        return f"blocks.{layer}.{_TRANSFORMER_LENS_NAME[hook]}"
    return f"{layer}.{hook}"


def site_order(name: str) -> tuple[int, int]:
    """Sort key of site names (either spelling): by layer, then by hook in stream order."""
    layer, hook = parse_site_name(name)
    return layer, HOOK_INDEX[hook]


def parse_site_name(name: str) -> tuple[int, Hook]:
    """``(layer, hook)`` of ``"12.post_block"`` or ``"blocks.12.hook_resid_post"``."""
    if match := _TRANSFORMER_LENS_SITE.fullmatch(name):
        return int(match[1]), TRANSFORMER_LENS_HOOKS[match[2]]
    layer, _, hook = name.partition(".")
    if hook not in HOOK_INDEX or not layer.isdigit():
        raise ValueError(f"bad site name {name!r}: expected '<layer>.<hook>' with hook in {HOOKS}, or "
                         "TransformerLens's 'blocks.<layer>.hook_resid_pre|mid|post'")
    return int(layer), hook  # type: ignore[return-value]


def is_site_name(name: object) -> bool:
    try:
        parse_site_name(name)  # type: ignore[arg-type]
    except (ValueError, TypeError, AttributeError):
        return False
    return True
