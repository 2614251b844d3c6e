"""Monkeypatch: intervention-aware prefix-cache block hashes.

Wraps ``vllm.v1.core.kv_cache_utils.generate_block_hash_extra_keys`` (vLLM 0.26), which the engine core's
block hasher looks up as a module global for every full block of a request. Requests whose KV is computed
under steering or patching carry ``extra_args["vllm_interp"]["prefix_salt"]`` (built by
``vllm_interp.frontend.prefix_salt``): a digest of the interventions and the first position whose KV they
change. Every block that ends after that position gets the digest as an extra key, so the hash chain forks
exactly there: a later request never reuses KV computed under another request's interventions, identical
specs still share, and blocks before the first changed position stay shared with everyone. There is no
extension point for this in vLLM 0.26, hence the patch.
"""

from typing import Any

from vllm_interp.engine.touchpoints import Touchpoint, check_touchpoints
from vllm_interp.request_args import interp_args

TOUCHPOINTS = (
    Touchpoint("vllm.v1.core.kv_cache_utils:generate_block_hash_extra_keys", "patch",
               "the block hasher looks it up for every full block; the interventions' digest joins its keys",
               params=("request", "start_token_idx", "end_token_idx", "start_mm_idx")),
    Touchpoint("vllm.v1.core.block_pool:generate_block_hash_extra_keys", "patch",
               "block_pool imported the name for KV-cache events; both must hash alike"),
    Touchpoint("vllm.v1.request:Request", "read", "the salt reads a request's sampling params and prompt length",
               params=("sampling_params",)),
)

SALT_TAG = "vllm_interp.interventions"
_installed = False


def _salt(request: Any, end_token_idx: int) -> tuple[str, str] | None:
    # The hasher asks for every full block of every request (decoded blocks too): the spec is read once.
    salt = getattr(request, "interp_prefix_salt", None)
    if salt is None:
        salt = request.interp_prefix_salt = _request_salt(request)
    key, first_changed = salt
    return key if key is not None and end_token_idx > first_changed else None


def _request_salt(request: Any) -> tuple[tuple[str, str] | None, int]:
    """The extra key of the request's blocks that end after the first position its interventions change, and
    that position (no key: an unsalted request)."""
    params = getattr(request, "sampling_params", None)
    salt = interp_args(params.extra_args if params is not None else None).get("prefix_salt")
    if not salt:
        return None, 0
    starts = [request.num_prompt_tokens] if salt["from_prompt_end"] else []
    if salt["from_position"] is not None:
        starts.append(salt["from_position"])
    return (SALT_TAG, salt["digest"]), min(starts)


def install() -> None:
    global _installed
    if _installed:
        return
    check_touchpoints(TOUCHPOINTS)
    from vllm.v1.core import block_pool, kv_cache_utils

    original = kv_cache_utils.generate_block_hash_extra_keys

    def generate_block_hash_extra_keys(request, start_token_idx, end_token_idx, start_mm_idx):
        extra_keys, next_mm_idx = original(request, start_token_idx, end_token_idx, start_mm_idx)
        salt = _salt(request, end_token_idx)
        if salt is not None:
            extra_keys = (*(extra_keys or ()), salt)
        return extra_keys, next_mm_idx

    kv_cache_utils.generate_block_hash_extra_keys = generate_block_hash_extra_keys
    # block_pool imported the name directly (it uses it for KV-cache events); keep both in step.
    block_pool.generate_block_hash_extra_keys = generate_block_hash_extra_keys
    _installed = True
