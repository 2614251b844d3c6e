"""The HTTP layer: `vllm-interp serve` (vLLM's OpenAI server with the interpretability engine)."""
