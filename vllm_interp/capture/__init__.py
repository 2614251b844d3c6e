"""Capture: copying residual rows out of the forward (today: the offline read-out)."""
