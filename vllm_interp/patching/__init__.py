"""Patching: overwriting or interpolating residual rows of a request with values from an earlier run."""
