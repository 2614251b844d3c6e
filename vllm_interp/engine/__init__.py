"""Engine glue: the vLLM plugin, the worker, the runner mixin and per-step row planning."""
