"""The offline ``vllm.LLM``'s internals vllm-interp uses: the engine's model config and its engine core."""

from typing import Any

from vllm_interp.engine.touchpoints import Touchpoint, check_attributes, check_touchpoints

TOUCHPOINTS = (
    Touchpoint("vllm.v1.engine.core_client:EngineCoreClient.shutdown", "call",
               "LLM.shutdown stops the engine processes now rather than at garbage collection"),
)
LLM_ATTRIBUTES = {
    "llm_engine.model_config": "the model's layers, width and context length",
    "llm_engine.engine_core": "the engine core client, shut down by LLM.shutdown",
}


def check_llm(llm: Any) -> None:
    check_touchpoints(TOUCHPOINTS)
    check_attributes(llm, "LLM", LLM_ATTRIBUTES)


def shutdown(llm: Any) -> None:
    llm.llm_engine.engine_core.shutdown()
