"""Model sites: where each supported architecture exposes its residual stream (see registry.py)."""
