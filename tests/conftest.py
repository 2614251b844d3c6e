"""Shared fixtures: the default model and its tokenizer, the shared offline engines (SmolLM2 with every feature,
plain vLLM), the transformers reference, and `vllm-interp serve` test servers."""

import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from benchmarks.serving import VLLM_INTERP, start_server, stop_server  # noqa: F401 (tests import them from here)
from vllm_interp.default_model import prepare_default_model
from vllm_interp.server.auth import API_KEY_ENV

# Prompts of different lengths; with max_num_batched_tokens=16 the longer ones are split across steps.
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "List three primary colors:",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog again and "
    "again, until the dog finally wakes up and",
]
ENGINE_KWARGS = dict(
    dtype="float32",
    max_model_len=512,
    max_num_batched_tokens=16,
    max_num_seqs=8,
    kv_cache_memory_bytes=128 << 20,
    seed=0,
)


def shutdown(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


@contextmanager
def engine_in_this_process() -> Iterator[None]:
    """Offline engines started within it run their core and worker in this process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): no two processes that import vLLM, no shutdown grace (a random-weight
    architecture's parity test, engine and reference, 5-11 s this way against 31-37 s with vLLM's processes on the
    dev CPU). For tests about what the model computes; the shared engines keep vLLM's default processes, whose
    boundaries the features' specs cross. Shut such an engine down within the block: leaving it undoes what an
    in-process engine core sets for its whole process (vLLM's environment cache, which would keep later engines
    in this process too, and its frozen heap, which would keep the engine's objects alive)."""
    import vllm.envs

    saved = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        yield
    finally:
        if saved is None:
            del os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"]
        else:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = saved
        vllm.envs.disable_envs_cache()
        gc.unfreeze()
        gc.collect()


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return prepare_default_model()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


@pytest.fixture(scope="session")
def smollm2_reference(smollm2_path):
    """transformers' SmolLM2 with hooks at every site: the independent reference (tests/reference.py)."""
    from tests.reference import HookedReference
    from tests.zoo import _input_of

    return HookedReference(smollm2_path, _input_of("post_attention_layernorm"))


@pytest.fixture(scope="session")
def prompt_ids(smollm2_tokenizer) -> list[list[int]]:
    return [smollm2_tokenizer(p).input_ids for p in PROMPTS]


# A fixed root (emptied per session) rather than a fresh temporary one: consumer options are part of the
# engine config that keys vLLM's compile cache, so a new path each run would recompile the model.
CAPTURE_ROOT = Path(tempfile.gettempdir()) / "vllm-interp-tests" / "captures"


@pytest.fixture(scope="session")
def capture_root() -> Path:
    shutil.rmtree(CAPTURE_ROOT, ignore_errors=True)
    CAPTURE_ROOT.mkdir(parents=True)
    return CAPTURE_ROOT


# A small sparse autoencoder in SAELens's format on blocks.6.hook_resid_post (fixed path, like CAPTURE_ROOT).
SAE_DIR = Path(tempfile.gettempdir()) / "vllm-interp-tests" / "sae-res6"
SAE_NAME, SAE_LAYER, SAE_FEATURES = "res6", 6, 64


@pytest.fixture(scope="session")
def test_sae() -> Path:
    """Writes the SAE: random decoder rows of norm 1, an encoder that fires on about a third of the features."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(6)
    w_dec = rng.standard_normal((SAE_FEATURES, HIDDEN)).astype(np.float32)
    w_dec /= np.linalg.norm(w_dec, axis=1, keepdims=True)
    SAE_DIR.mkdir(parents=True, exist_ok=True)
    save_file({"W_enc": np.ascontiguousarray(w_dec.T), "b_enc": np.full(SAE_FEATURES, -0.5, np.float32),
               "W_dec": w_dec, "b_dec": (0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)},
              str(SAE_DIR / "sae_weights.safetensors"))
    (SAE_DIR / "cfg.json").write_text(json.dumps({
        "architecture": "standard", "d_in": HIDDEN, "d_sae": SAE_FEATURES, "dtype": "float32",
        "apply_b_dec_to_input": True, "normalize_activations": "none",
        "metadata": {"hook_name": f"blocks.{SAE_LAYER}.hook_resid_post", "model_name": "SmolLM2-135M-Instruct"}}))
    return SAE_DIR


@pytest.fixture(scope="session")
def smollm2_llm(smollm2_path, capture_root, test_sae):
    """The shared SmolLM2 engine: fp32, torch.compile on, chunked prefill forced small, steering, patching,
    the built-in capture consumers and the test SAE enabled. Tests that set global steering clear it before
    they return."""
    from vllm_interp import LLM

    # Small parts and shards, so that a sharded capture is taken in parts and its shards are published soon.
    consumers = ("inline", f"filesystem:root={capture_root},part_mb=1,shard_mb=1", "logging:max_positions=4",
                 "sae_features")
    llm = LLM(str(smollm2_path), enable_steering=True, max_steering_configs=4, enable_patching=True,
              capture_consumers=consumers, saes={SAE_NAME: str(test_sae)}, **ENGINE_KWARGS)
    yield llm
    shutdown(llm)


@pytest.fixture(scope="session")
def plain_llm(smollm2_path):
    """Plain vLLM on the same weights and settings: the baseline an interpretability feature must not move."""
    from vllm import LLM

    llm = LLM(str(smollm2_path), **ENGINE_KWARGS)
    yield llm
    shutdown(llm)


@pytest.fixture(scope="session")
def parity_table():
    rows: list[tuple[str, object]] = []
    yield rows
    if rows:
        print("\n\nResidual-stream parity against transformers (fp32)")
        print(f"{'architecture':<28}{'sites':>7}{'rows':>8}{'max abs diff':>15}{'max rel diff':>15}  worst row")
        for name, r in rows:
            print(f"{name:<28}{r.sites_checked:>7}{r.rows_checked:>8}{r.max_abs_diff:>15.3e}{r.max_rel_diff:>15.3e}"
                  f"  {r.worst_row}")


# -- `vllm-interp serve`: default model, steering on, API keys (flag and env), a named vector loaded at start-up --
API_KEY = "test-steering-key"
# The session server also takes keys from the environment (two, comma-separated), beside the flag's.
ENV_API_KEYS = ("test-env-key-one", "test-env-key-two")
HIDDEN = 576


def vector(seed: int, norm: float = 8.0, size: int = HIDDEN) -> list[float]:
    v = np.random.default_rng(seed).standard_normal(size).astype(np.float32)
    return (v / np.linalg.norm(v) * norm).tolist()


EXAMPLE_CONSUMER = Path(__file__).parent.parent / "examples" / "capture_consumers" / "activation_stats"
# The server captures post_block of layer 3 at the last prompt token of every request into this consumer.
GLOBAL_CAPTURE = {"activation_stats": {"hooks": {"post_block": [3]}, "positions": "last_prompt"}}


def install_example_consumer(target: Path) -> Path:
    """pip-install the third-party example consumer into ``target`` (a PYTHONPATH entry), as a user would."""
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target",
                    str(target), str(EXAMPLE_CONSUMER)], check=True)
    shutil.rmtree(EXAMPLE_CONSUMER / "build", ignore_errors=True)
    return target


@pytest.fixture(scope="session")
def server_dirs(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("server")
    return {"plugins": install_example_consumer(base / "plugins"), "captures": base / "captures",
            "stats": base / "stats.jsonl", "vectors": base / "formal.json"}


def launch_server(args: list[str], log: Path, env: dict[str, str] | None = None) -> tuple[str, subprocess.Popen]:
    """Start `vllm-interp serve ARGS` in its own process group (so that a test can kill every process of the
    server at once) and wait until it answers /health. Output goes to ``log``."""
    try:
        return start_server(args, log, env, timeout_s=600)
    except RuntimeError as exc:
        pytest.fail(f"{exc}:\n{log.read_text()[-4000:]}")


# Small settings shared by every test server; --enforce-eager: the compiled path is covered by the offline
# engines, these tests are about the CLI and HTTP.
SERVER_ARGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "512",
               "--kv-cache-memory-bytes", str(128 << 20), "--seed", "0"]


@pytest.fixture(scope="session")
def server(smollm2_path, server_dirs, test_sae):
    server_dirs["vectors"].write_text(json.dumps({"vectors": {"post_block": {"6": vector(42)}}}))
    args = [
        *SERVER_ARGS, "--enable-steering", "--enable-patching",
        "--steering-api-key", API_KEY, "--steering-vectors", f"formal={server_dirs['vectors']}",
        "--max-steering-configs", "2",
        "--capture-consumers", "inline", "--capture-consumers", f"filesystem:root={server_dirs['captures']}",
        "--capture-consumers", f"activation_stats:path={server_dirs['stats']}",
        "--capture-global", json.dumps(GLOBAL_CAPTURE),
        "--sae", f"{SAE_NAME}={test_sae}", "--capture-consumers", "sae_features",
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(server_dirs["plugins"]),
                                                                     os.environ.get("PYTHONPATH")])),
           API_KEY_ENV: ",".join(ENV_API_KEYS)}
    url, process = launch_server(args, server_dirs["captures"].parent / "server.log", env)
    try:
        yield url, process
    finally:
        stop_server(process)


@pytest.fixture(scope="session")
def open_server(smollm2_path, tmp_path_factory):
    """A second server: steering and patching on, no --steering-api-key and the key variable unset (whatever
    the caller's shell has), two sequences at a time (so most of a sweep's cells wait in the scheduler)."""
    env = {name: value for name, value in os.environ.items() if name != API_KEY_ENV}
    log = tmp_path_factory.mktemp("open-server") / "server.log"
    url, process = launch_server([*SERVER_ARGS, "--enable-steering", "--enable-patching", "--max-num-seqs", "2"],
                                 log, env)
    try:
        yield url
    finally:
        stop_server(process)
