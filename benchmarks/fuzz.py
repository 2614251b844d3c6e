"""Fuzz a `vllm-interp serve` it starts itself (every feature on, the default model) with 10,000+ cases from
tests/server/fuzzing.py's strategies, and report: counts per status code, endpoint and mode, every failure of
the property with the request that failed, the background stream's result (fixed greedy requests whose output
must not move), and the server's RSS (all its processes) at start and end.

    flock /tmp/vllm-engine.lock .venv/bin/python -m benchmarks.fuzz --cases 10000 --out fuzz.json

A case after which the server stops answering /health is recorded as "server died"; the server is then
restarted (at most ``--restarts`` times) and fuzzing goes on.

Schemathesis is not run: vLLM's /openapi.json lists our routes without request schemas (they read the body
themselves) and its CompletionRequest schema does not know the fields the middleware takes out
(``steering_vectors``, ``capture``, ``patch``, ...), so a schema-driven fuzzer would exercise vLLM's fields
only. ``openapi_coverage`` checks that on the running server and the report says what it found.
"""

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import requests
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from safetensors.numpy import save_file

from benchmarks.serving import server_rss_mb, start_server, stop_server
from tests.conftest import (
    API_KEY,
    ENV_API_KEYS,
    GLOBAL_CAPTURE,
    HIDDEN,
    SAE_FEATURES,
    SAE_LAYER,
    SAE_NAME,
    SERVER_ARGS,
    install_example_consumer,
    vector,
)
from tests.server import fuzzing
from vllm_interp.server.auth import API_KEY_ENV

# Every built-in consumer, the example third-party one, and patch_source (--enable-patching).
CONSUMERS = ("inline", "filesystem", "logging", "activation_stats", "sae_features", "patch_source")
OUR_ROUTES = ("/v1/steering/set", "/v1/steering/clear", "/v1/steering/vectors/register",
              "/v1/steering/vectors/unregister", "/v1/steering/vectors/contrastive", "/v1/patch_sweep")


def write_sae(directory: Path) -> Path:
    """A random SAELens-format SAE on blocks.{SAE_LAYER}.hook_resid_post (steering features, sae_features)."""
    rng = np.random.default_rng(SAE_LAYER)
    decoder = rng.standard_normal((SAE_FEATURES, HIDDEN)).astype(np.float32)
    decoder /= np.linalg.norm(decoder, axis=1, keepdims=True)
    directory.mkdir(parents=True, exist_ok=True)
    save_file({"W_enc": np.ascontiguousarray(decoder.T), "b_enc": np.full(SAE_FEATURES, -0.5, np.float32),
               "W_dec": decoder, "b_dec": np.zeros(HIDDEN, np.float32)}, str(directory / "sae_weights.safetensors"))
    (directory / "cfg.json").write_text(json.dumps({
        "architecture": "standard", "d_in": HIDDEN, "d_sae": SAE_FEATURES, "dtype": "float32",
        "apply_b_dec_to_input": True, "normalize_activations": "none",
        "metadata": {"hook_name": f"blocks.{SAE_LAYER}.hook_resid_post"}}))
    return directory


class Server:
    """`vllm-interp serve` with every feature on, configured like the test suite's session server plus the
    logging consumer; ``restart`` after a death."""

    def __init__(self, base: Path) -> None:
        self.base = base
        plugins = install_example_consumer(base / "plugins")
        sae = write_sae(base / "sae")
        (base / "formal.json").write_text(json.dumps({"vectors": {"post_block": {"6": vector(42)}}}))
        self.args = [
            *SERVER_ARGS, "--enable-steering", "--enable-patching", "--steering-api-key", API_KEY,
            "--steering-vectors", f"{fuzzing.PRELOADED_NAME}={base / 'formal.json'}", "--max-steering-configs", "2",
            "--capture-consumers", "inline", "--capture-consumers", f"filesystem:root={base / 'captures'}",
            "--capture-consumers", "logging:max_positions=4",
            "--capture-consumers", f"activation_stats:path={base / 'stats.jsonl'}",
            "--capture-global", json.dumps(GLOBAL_CAPTURE),
            "--sae", f"{SAE_NAME}={sae}", "--capture-consumers", "sae_features",
        ]
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(plugins),
                                                                              os.environ.get("PYTHONPATH")])),
                    API_KEY_ENV: ",".join(ENV_API_KEYS)}
        self.starts = 0
        self.url, self.process = "", None
        self.start()

    def start(self) -> None:
        self.starts += 1
        self.url, self.process = start_server(self.args, self.base / f"server-{self.starts}.log", self.env)

    def stop(self) -> None:
        if self.process is not None:
            stop_server(self.process)

    def restart(self) -> None:
        self.stop()
        self.start()

    def rss_mib(self) -> float:
        """Resident memory of the server and every process under it (API server, engine core, worker)."""
        return sum(server_rss_mb(self.process.pid).values())


def openapi_coverage(url: str) -> dict[str, Any]:
    """Whether vLLM's OpenAPI document could drive a schema fuzzer over our surface: which of our routes
    declare a request body, and which of our generation fields the completion request schemas know."""
    spec = requests.get(f"{url}/openapi.json", timeout=30).json()
    routes = {path: "requestBody" in spec["paths"].get(path, {}).get("post", {}) for path in OUR_ROUTES}
    schemas = spec.get("components", {}).get("schemas", {})
    known = {name: sorted(set(fuzzing.GENERATION_FIELDS) & set(schemas.get(name, {}).get("properties", {})))
             for name in ("CompletionRequest", "ChatCompletionRequest")}
    return {"routes_with_request_schema": routes, "generation_fields_in_schema": known}


# Each family's share of the cases (generation bodies carry most of our fields).
SHARES = {"generation": 0.5, "steering_routes": 0.2, "patch_routes": 0.2, "raw_bodies": 0.1}


def fuzz(server: Server, cases: int, seed: int, max_restarts: int) -> dict[str, Any]:
    fuzzer = fuzzing.Fuzzer(server.url)
    fuzzer.prepare()
    backgrounds: list[fuzzing.BackgroundResult] = []
    stream = fuzzing.BackgroundStream(server.url)
    stream.start()
    deaths: list[str] = []
    started, done = time.monotonic(), 0

    def one(case: fuzzing.Case) -> None:
        nonlocal fuzzer, stream, done
        try:
            fuzzer.run(case)
        except fuzzing.ServerDied as died:
            deaths.append(str(died.failure))
            fuzzer.tally.failures.append(died.failure)
            backgrounds.append(stream.stop())
            if len(deaths) > max_restarts:
                raise
            server.restart()
            tally, fuzzer = fuzzer.tally, fuzzing.Fuzzer(server.url)
            fuzzer.tally = tally
            fuzzer.prepare()
            stream = fuzzing.BackgroundStream(server.url)
            stream.start()
        done += 1
        if done % 500 == 0:
            t = fuzzer.tally
            print(f"{done} cases, {time.monotonic() - started:.0f} s, {len(t.failures)} failures, "
                  f"RSS {server.rss_mib():.0f} MiB, statuses {dict(sorted(t.statuses.items(), key=str))}", flush=True)

    for i, (family, strategy) in enumerate(fuzzing.families(CONSUMERS).items()):
        examples = round(cases * SHARES[family])
        run = settings(max_examples=examples, database=None, deadline=None, phases=[Phase.generate],
                       suppress_health_check=list(HealthCheck))(given(strategy)(one))
        hypothesis_seed(seed + i)(run)()
    backgrounds.append(stream.stop())
    tally = fuzzer.tally
    return {"tally": tally, "backgrounds": backgrounds, "deaths": deaths,
            "wall_s": time.monotonic() - started}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--restarts", type=int, default=5, help="server restarts after deaths before giving up")
    parser.add_argument("--out", type=Path, default=None, help="write the figures and every failure as JSON here")
    args = parser.parse_args()
    # A SIGTERM (a timeout) unwinds like an exception, so that the server is stopped with us.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    base = Path(tempfile.mkdtemp(prefix="vllm-interp-fuzz-"))
    server = Server(base)
    try:
        coverage = openapi_coverage(server.url)
        rss_start = server.rss_mib()
        result = fuzz(server, args.cases, args.seed, args.restarts)
        rss_end = server.rss_mib()
    finally:
        server.stop()
        shutil.rmtree(base, ignore_errors=True)
    tally: fuzzing.Tally = result["tally"]
    print(f"\n{tally.cases} cases in {result['wall_s']:.0f} s (seed {args.seed}); server starts: {server.starts}")
    print(f"RSS of the server's processes: {rss_start:.0f} MiB at start, {rss_end:.0f} MiB at the end")
    for title, counts in (("status", tally.statuses), ("mode", tally.modes)):
        print(f"\nper {title}:")
        for key, count in sorted(counts.items(), key=lambda kv: -kv[1]):
            print(f"  {count:>6}  {key}")
    print("\nper endpoint (by status):")
    for endpoint, count in sorted(tally.endpoints.items(), key=lambda kv: -kv[1]):
        statuses = {status: n for (e, status), n in tally.endpoint_statuses.items() if e == endpoint}
        print(f"  {count:>6}  {endpoint}  {dict(sorted(statuses.items(), key=str))}")
    for i, background in enumerate(result["backgrounds"]):
        print(f"\nbackground stream (server start {i + 1}): {background}")
    print(f"\nschemathesis evaluation (vLLM's /openapi.json): {json.dumps(coverage)}")
    print("\n" + fuzzing.summarize(tally.failures, limit=60))
    if args.out:
        args.out.write_text(json.dumps({
            "cases": tally.cases, "seed": args.seed, "wall_s": result["wall_s"], "server_starts": server.starts,
            "rss_mib": {"start": rss_start, "end": rss_end}, "statuses": {str(k): v for k, v in tally.statuses.items()},
            "endpoints": {endpoint: {str(status): n for (e, status), n in tally.endpoint_statuses.items()
                                     if e == endpoint} for endpoint in tally.endpoints},
            "modes": dict(tally.modes), "openapi": coverage,
            "backgrounds": [str(b) for b in result["backgrounds"]], "deaths": result["deaths"],
            "failures": [vars(f) for f in tally.failures],
        }, indent=1))


if __name__ == "__main__":
    main()
