"""The ``vllm.general_plugins`` entry point, run by vLLM once in every process it starts.

vLLM loads general plugins in the API server, the engine core and every worker (each a fresh ``spawn``ed
process on CPU), so everything here is idempotent and reads no arguments.
"""

_loaded = False


def load() -> None:
    global _loaded
    if _loaded:
        return
    from vllm_interp.engine.versions import adapter

    internals = adapter()  # refuses an unsupported vLLM
    # Register the site op before any model is traced in this process.
    import vllm_interp.models.site_ops  # noqa: F401

    # Engine core: salt block hashes of steered requests, and hold requests that have no steering slot
    # (both are no-ops in processes that never hash or schedule, and for requests without steering).
    internals.install_engine_core_patches()

    _loaded = True
