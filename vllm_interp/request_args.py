"""The per-request payload vllm-interp carries in ``SamplingParams.extra_args``.

Everything lives under one key so that it never collides with other users of ``extra_args`` and stays
msgpack-plain on its way from the frontend to the workers. Over HTTP the value arrives as a JSON string,
because ``vllm_xargs`` (how OpenAI requests reach ``extra_args``) admits no nested objects.
"""

import json
from typing import Any

EXTRA_ARGS_KEY = "vllm_interp"


def interp_args(extra_args: dict[str, Any] | None) -> dict[str, Any]:
    value = (extra_args or {}).get(EXTRA_ARGS_KEY) or {}
    if isinstance(value, str):
        # Parsed once per process: the scheduler and the block hasher ask on every step and block.
        value = json.loads(value)
        extra_args[EXTRA_ARGS_KEY] = value
    return value


def with_interp_args(extra_args: dict[str, Any] | None, **fields: Any) -> dict[str, Any]:
    merged = dict(extra_args or {})
    merged[EXTRA_ARGS_KEY] = {**interp_args(extra_args), **fields}
    return merged
