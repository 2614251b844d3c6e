import gc
from pathlib import Path

import pytest

from vllm_interp.default_model import prepare_default_model

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


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return prepare_default_model()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


@pytest.fixture(scope="session")
def prompt_ids(smollm2_tokenizer) -> list[list[int]]:
    return [smollm2_tokenizer(p).input_ids for p in PROMPTS]


@pytest.fixture(scope="session")
def smollm2_llm(smollm2_path):
    """The shared SmolLM2 engine: fp32, torch.compile on, chunked prefill forced small, read-out and
    steering enabled. Tests that set global steering clear it before they return."""
    from vllm_interp import LLM

    llm = LLM(str(smollm2_path), enable_steering=True, max_steering_configs=4, **ENGINE_KWARGS)
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
        print(f"{'architecture':<24}{'sites':>7}{'rows':>8}{'max abs diff':>15}{'max rel diff':>15}")
        for name, r in rows:
            print(f"{name:<24}{r.sites_checked:>7}{r.rows_checked:>8}{r.max_abs_diff:>15.3e}{r.max_rel_diff:>15.3e}")
