"""vLLM 0.26's request ids: the engine's id is the caller's plus ``-`` and 8 random hex characters
(``InputProcessor.assign_request_id``); capture metadata and file names carry the caller's id."""

import re

from vllm_interp.engine.touchpoints import Touchpoint

TOUCHPOINTS = (
    Touchpoint("vllm.v1.engine.input_processor:InputProcessor.assign_request_id", "read",
               "internal ids are the caller's plus '-<8 hex>'; captures report the caller's", params=("request",)),
)
_INTERNAL_SUFFIX = re.compile(r"-[0-9a-f]{8}$")


def external_request_id(req_id: str) -> str:
    return _INTERNAL_SUFFIX.sub("", req_id)
