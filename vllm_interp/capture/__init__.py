"""Capture: copying residual rows out of the forward to consumers (files, logs, the caller, patch sources)."""
