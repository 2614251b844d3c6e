"""The one naming scheme for residual-stream hook sites, used by every subsystem.

A site is ``(layer, hook)``; its name is ``"{layer}.{hook}"`` (e.g. ``"12.post_block"``).

- ``pre_attn``: the stream entering decoder layer ``layer``.
- ``post_attn``: the stream after the attention block's residual add, before the MLP.
- ``post_block``: the stream leaving the layer (before the final norm for the last layer);
  equal to ``pre_attn`` of ``layer + 1``.
"""

from typing import Literal

Hook = Literal["pre_attn", "post_attn", "post_block"]
HOOKS: tuple[Hook, ...] = ("pre_attn", "post_attn", "post_block")
HOOK_INDEX: dict[str, int] = {hook: i for i, hook in enumerate(HOOKS)}


def site_name(layer: int, hook: str) -> str:
    return f"{layer}.{hook}"


def site_order(name: str) -> tuple[int, int]:
    """Sort key of site names: by layer, then by hook in stream order."""
    layer, hook = parse_site_name(name)
    return layer, HOOK_INDEX[hook]


def parse_site_name(name: str) -> tuple[int, Hook]:
    layer, _, hook = name.partition(".")
    if hook not in HOOK_INDEX or not layer.isdigit():
        raise ValueError(f"bad site name {name!r}: expected '<layer>.<hook>' with hook in {HOOKS}")
    return int(layer), hook  # type: ignore[return-value]
