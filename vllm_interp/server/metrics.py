"""Prometheus metrics of the API server's own capture work, served with vLLM's on ``/metrics``.

A response that carries capture results (a body, or a stream's last event) waits for them after vLLM's last
output: first for the workers' consumers (``wait``), then for the results to be unpacked, merged and made
JSON-able (``prepare``). vLLM's end-to-end latency stops where that wait starts.
"""

from prometheus_client import Histogram

_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

RESULTS_WAIT = Histogram(
    "vllm_interp:capture_results_wait_seconds",
    "From a capturing request's last output to its consumers' results reaching the API server.",
    buckets=_BUCKETS,
)
RESULTS_PREPARE = Histogram(
    "vllm_interp:capture_results_prepare_seconds",
    "Unpacking, merging and converting a request's capture results to JSON on the API server.",
    buckets=_BUCKETS,
)
