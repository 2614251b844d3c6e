"""Where every-token capture's decode time goes, on one in-process engine (a diagnostic for the GPU).

    VLLM_ENABLE_V1_MULTIPROCESSING=0 python -m benchmarks.capture_breakdown MODEL [--requests 64]
        [--prompt-tokens 128] [--max-tokens 256] [--rounds 2] [--profile plain,full]

Every request captures ``post_block`` of every layer at every generated position to ``--consumer``
(``logging`` by default). Between passes on the same engine, the host copier's submission
(``HostCopier.submit``), its wait for the copy (``HostCopier._to_host``) or its per-request split
(``HostCopy.land``) are swapped for variants that each drop or change one part of the move to host memory,
and each pass reports the median decode TPOT (first to last token over the tokens between them) against a
pass that captures nothing, in rounds (A B C ... A B C):

- ``plain``: no capture.
- ``full``: as shipped (the forward thread queues an asynchronous copy into pinned memory; the copier thread
  waits for it and splits it per request).
- ``pageable``: the path shipped before: the copier thread copies the block itself, from its own stream into
  pageable memory (``.to("cpu")``), then splits it.
- ``no_split``: as shipped, but each request is filed a view of the step's block (no per-request copy).
- ``no_transfer``: the copy is started but its result ignored: every step lands a preallocated host block of
  the right shape (consumers get zeros); planning, the in-graph read, the gather, filing and consumers as usual.
- ``no_thread``: no device->host copy and no copier thread: the forward thread lands views of a preallocated
  host block at once (consumers get zeros).
- ``switch_interval``: as shipped, with the interpreter's thread switch interval at 0.2 ms.

``--profile VARIANT,...`` (e.g. ``plain,full``) adds a torch profiler pass of each named variant (the top
host-side functions by self time, CUDA runtime calls included); ``--cprofile VARIANT,...`` a pass under
Python's profiler (the engine runs in this process, so its whole loop shows: the top functions by own time,
then vllm-interp's by cumulative time, per decode step). ``--consumer`` picks what the requests capture to:
``logging`` takes statistics reduced on the device, so the host copier's variants only change anything with
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
from vllm_interp.capture import host_copies

MODE = {"name": "full"}
_HOST_BLOCKS: dict[tuple, torch.Tensor] = {}


_shipped_to_host = host_copies.HostCopier._to_host
_shipped_land = host_copies.HostCopy.land
_shipped_submit = host_copies.HostCopier.submit


def _to_host_variants(copy: host_copies.HostCopy) -> torch.Tensor:
    """HostCopier._to_host with the variants above, chosen per copy from MODE."""
    mode = MODE["name"]
    if mode == "no_transfer":
        copy.event.synchronize()
        return _host_block(tuple(copy.pinned.shape), copy.pinned.dtype)
    if mode == "pageable":
        stream = _PAGEABLE.setdefault("stream", torch.cuda.Stream())
        with torch.cuda.stream(stream):
            stream.wait_event(copy.event)
            return copy.device_block.to("cpu")
    return _shipped_to_host(copy)


_PAGEABLE: dict[str, torch.cuda.Stream] = {}


def _land_variants(self: host_copies.HostCopy, host: torch.Tensor) -> None:
    if MODE["name"] != "no_split":
        return _shipped_land(self, host)
    self.parts = [host[:, start:stop] for start, stop in self.splits]
    self.pinned = self.event = None
    self._done.set()


def _submit_variants(self: host_copies.HostCopier, block: torch.Tensor, splits: list[tuple[int, int]]):
    mode = MODE["name"]
    if mode == "no_thread":
        host = _host_block(tuple(block.shape), block.dtype)
        copy = host_copies.HostCopy(splits)
        copy.parts = [host[:, start:stop] for start, stop in splits]
        copy._done.set()
        return copy
    if mode != "pageable":
        return _shipped_submit(self, block, splits)
    copy = host_copies.HostCopy(splits, block.numel() * block.element_size())
    copy.device_block, copy.event = block, torch.cuda.Event()
    copy.event.record()
    with self._cond:
        self._cond.wait_for(lambda: not self._in_flight or self._in_flight + copy.nbytes <= self.max_bytes)
        self._in_flight += copy.nbytes
        self._queue.append(copy)
        self._cond.notify_all()
    return copy


def _host_block(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    if (shape, dtype) not in _HOST_BLOCKS:
        _HOST_BLOCKS[(shape, dtype)] = torch.zeros(shape, dtype=dtype)
    return _HOST_BLOCKS[(shape, dtype)]


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
                        default="plain,full,pageable,no_split,no_transfer,no_thread")
    args = parser.parse_args()

    host_copies.HostCopier._to_host = staticmethod(_to_host_variants)
    host_copies.HostCopy.land = _land_variants
    host_copies.HostCopier.submit = _submit_variants
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
        one_pass(variant, 999)  # warm-up (graphs, consumer process, copier thread)
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
