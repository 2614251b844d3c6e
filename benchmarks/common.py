"""What every engine benchmark shares: its command-line options, engine settings, prompts and sampling."""

import argparse
from typing import Any

from vllm import SamplingParams

from vllm_interp.default_model import resolve_model

ENGINE = dict(max_model_len=1024, kv_cache_memory_bytes=512 << 20, seed=0)


def engine_parser(doc: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--attention-backend", default=None, help="TRITON_ATTN on the lent GPU")
    return parser


def engine_setup(args: argparse.Namespace) -> tuple[str, dict[str, Any], list[str], SamplingParams]:
    """(model path, engine kwargs, prompts, greedy sampling params) for the parsed options."""
    engine = dict(ENGINE, enforce_eager=args.enforce_eager, dtype=args.dtype)
    if args.attention_backend:
        engine["attention_backend"] = args.attention_backend
    prompts = [f"Write a short story about a robot named Unit {i} who" for i in range(args.prompts)]
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    return resolve_model(args.model), engine, prompts, greedy
