"""Where every-token capture's decode time goes, on one in-process engine (a diagnostic for the GPU).

    VLLM_ENABLE_V1_MULTIPROCESSING=0 python -m benchmarks.capture_breakdown MODEL [--requests 64]
        [--prompt-tokens 128] [--max-tokens 256] [--rounds 2] [--profile plain,full]

Every request captures ``post_block`` of every layer at every generated position to ``--consumer``
(``logging`` by default). Between passes on the same engine, the move of each step's rows to host memory
(``store.to_host``) is swapped for variants, and each pass reports the median decode TPOT (first to last
token over the tokens between them) against a pass that captures nothing, in rounds (A B C ... A B C):

- ``plain``: no capture.
- ``full``: as shipped (the forward thread queues an asynchronous copy into pinned memory and lands it at a
  later step: whole, read where it landed, or split per request, as ``host_copies.to_host`` decides).
- ``no_copy``: no device->host copy at all: each step lands a preallocated host block of the right shape at
  once (consumers get zeros), split per request as shipped; planning, the in-graph read, the gather, filing
  and consumers as usual.
- ``switch_interval``: as shipped, with the interpreter's thread switch interval at 0.2 ms.

``--profile VARIANT,...`` (e.g. ``plain,full``) adds a torch profiler pass of each named variant (the top
host-side functions by self time, CUDA runtime calls included); ``--cprofile VARIANT,...`` a pass under
Python's profiler (the engine runs in this process, so its whole loop shows: the top functions by own time,
then vllm-interp's by cumulative time, per decode step). ``--consumer`` picks what the requests capture to:
``logging`` takes statistics reduced on the device, so the variants change most with
a consumer that takes whole rows (``inline``).
Results are printed; nothing in the product changes. The default variant list runs in about 4 minutes on an
H100 (engine start included).
"""

import argparse
import cProfile
import pstats
import statistics
import sys
import threading
import time

import torch
from vllm import SamplingParams

from vllm_interp import LLM
from vllm_interp.capture import host_copies, store

MODE = {"name": "full"}
_HOST_BLOCKS: dict[tuple, torch.Tensor] = {}
_shipped_to_host = store.to_host


def _to_host_variants(block: torch.Tensor, splits: list[tuple[int, int]], whole: bool = False,
                      in_parts: bool = False):
    """``store.to_host`` with the variants above, chosen per step from MODE."""
    if MODE["name"] != "no_copy":
        return _shipped_to_host(block, splits, whole, in_parts)
    key = (tuple(block.shape), block.dtype)
    if key not in _HOST_BLOCKS:
        _HOST_BLOCKS[key] = torch.zeros(key[0], dtype=block.dtype)
    return host_copies.SplitCopy.landed(_HOST_BLOCKS[key], splits)


def decode_tpot_ms(outputs) -> float:
    per_request = []
    for out in outputs:
        m, n = out.metrics, len(out.outputs[0].token_ids)
        if m is not None and n > 1 and m.last_token_ts > m.first_token_ts:
            per_request.append((m.last_token_ts - m.first_token_ts) / (n - 1) * 1e3)
    return statistics.median(per_request) if per_request else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--profile", default="", help="variants to profile, comma-separated")
    parser.add_argument("--cprofile", default="", help="variants to run under cProfile, comma-separated")
    parser.add_argument("--consumer", default="logging", choices=("logging", "inline"))
    parser.add_argument("--attention-backend", default=None, help="TRITON_ATTN on the lent GPU")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--variants",
                        default="plain,full,no_copy")
    args = parser.parse_args()

    store.to_host = _to_host_variants
    backend = {"attention_backend": args.attention_backend} if args.attention_backend else {}
    llm = LLM(model=args.model, dtype=args.dtype, capture_consumers=(args.consumer,), **backend,
              max_model_len=args.prompt_tokens + args.max_tokens + 8, kv_cache_memory_bytes=2 << 30,
              disable_log_stats=False, seed=0)
    num_layers = llm.num_layers
    vocab = llm.llm_engine.model_config.get_vocab_size()
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    capture = {args.consumer: {"hooks": {"post_block": "all"}, "positions": "all_generated"}}
    print(f"model {args.model}: {num_layers} layers; {args.requests} requests x {args.prompt_tokens} prompt + "
          f"{args.max_tokens} generated tokens; capture {capture}", flush=True)

    def prompts(seed: int) -> list[dict]:
        g = torch.Generator().manual_seed(seed)
        return [{"prompt_token_ids": torch.randint(3, vocab, (args.prompt_tokens,), generator=g).tolist()}
                for _ in range(args.requests)]

    def one_pass(variant: str, seed: int) -> float:
        MODE["name"] = "full" if variant in ("plain", "switch_interval") else variant
        sys.setswitchinterval(0.0002 if variant == "switch_interval" else 0.005)
        kwargs = {} if variant == "plain" else {"capture": capture}
        outs = llm.generate(prompts(seed), params, use_tqdm=False, **kwargs)
        for out in outs if variant != "plain" else ():
            assert all(r.status == "ok" for r in out.capture.values()), out.capture
        return decode_tpot_ms(outs)

    variants = args.variants.split(",")
    for variant in variants:
        one_pass(variant, 999)  # warm-up (graphs, consumer process)
    table: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(args.rounds):
        for variant in variants:
            start = time.perf_counter()
            table[variant].append(one_pass(variant, r))
            print(f"round {r} {variant}: decode TPOT {table[variant][-1]:.2f} ms "
                  f"({time.perf_counter() - start:.1f} s)", flush=True)
    plain = statistics.median(table["plain"]) if "plain" in table else float("nan")
    print("\n| variant | decode TPOT ms per round | median / plain |\n|---|---|---|")
    for variant, values in table.items():
        print(f"| {variant} | {' / '.join(f'{v:.2f}' for v in values)} | {statistics.median(values) / plain:.2f} |")
    print(f"threads alive: {[t.name for t in threading.enumerate()]}")

    for variant in filter(None, args.cprofile.split(",")):
        profiler = cProfile.Profile()
        profiler.enable()
        one_pass(variant, 400)
        profiler.disable()
        steps = args.max_tokens  # every request decodes in the same steps
        print(f"\n## cProfile: {variant} (times per pass; {steps} decode steps)\n")
        stats = pstats.Stats(profiler)
        stats.sort_stats("tottime").print_stats(30)
        stats.sort_stats("cumulative").print_stats("vllm_interp", 30)

    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        for variant in args.profile.split(","):
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            with profile(activities=activities) as prof:
                one_pass(variant, 500)
            print(f"\n## profile: {variant}\n")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60))


if __name__ == "__main__":
    main()
