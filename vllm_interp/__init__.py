"""vllm-interp: residual-stream interpretability inside vLLM's forward pass."""

from vllm_interp.hooks import HOOKS, site_name

__version__ = "0.1.0"

__all__ = [
    "HOOKS", "LLM", "CaptureConsumer", "ResidualReadout", "__version__", "pack_vectors", "patched_params",
    "site_name", "steered_params",
]


def __getattr__(name: str):
    # vLLM is imported lazily so that the CLI, the plugin and the hook naming stay cheap to import.
    if name == "LLM":
        from vllm_interp.llm import LLM

        return LLM
    if name == "steered_params":
        from vllm_interp.steering.params import steered_params

        return steered_params
    if name == "patched_params":
        from vllm_interp.patching.params import patched_params

        return patched_params
    if name == "pack_vectors":
        from vllm_interp.steering.vectors import pack_vectors

        return pack_vectors
    if name == "ResidualReadout":
        from vllm_interp.capture.consumers.inline import ResidualReadout

        return ResidualReadout
    if name == "CaptureConsumer":
        from vllm_interp.capture.consumer import CaptureConsumer

        return CaptureConsumer
    raise AttributeError(name)
