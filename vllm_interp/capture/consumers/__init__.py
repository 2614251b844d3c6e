"""Capture consumers that ship with vllm-interp."""
