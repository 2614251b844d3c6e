"""Steering: adding vectors to the residual stream, server-wide and per request, in tiers."""
