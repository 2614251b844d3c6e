"""Where every-token capture's decode time goes, on one in-process engine (a diagnostic for the GPU).

    VLLM_ENABLE_V1_MULTIPROCESSING=0 python -m benchmarks.capture_breakdown MODEL [--requests 64]
        [--prompt-tokens 128] [--max-tokens 256] [--rounds 2] [--profile plain,full]

Every request captures ``post_block`` of every layer at every generated position to ``--consumer``
(``logging`` by default, in its own process). Between passes on the same engine, the host copier's transfer
(``HostCopier._to_host``), its per-request split (``HostCopy.land``) or its submission are swapped for
variants that each drop or change one part of the move to host memory, and each pass reports the median
decode TPOT (first to last token over the tokens between them) against a pass that captures nothing, in
rounds (A B C ... A B C):

- ``plain``: no capture.
- ``full``: the copier as shipped.
- ``no_split``: the copy, but each request is filed a view of the step's block (no per-request clone).
- ``no_transfer``: no device->host copy at all: every step lands a preallocated host block of the right shape
  (consumers get zeros); planning, the in-graph read, the gather, filing and consumers as usual.
- ``no_thread``: no device->host copy and no copier thread: the forward thread lands views of a preallocated
  host block at once (consumers get zeros).
- ``switch_interval``: the shipped copier with the interpreter's thread switch interval at 0.2 ms.
- ``staging_poll`` / ``staging_sync``: the copy goes through one pinned staging buffer allocated once (an
  asynchronous copy on the copier's stream, its event polled every 0.2 ms / waited for), then a host copy into
  ordinary memory, instead of a pageable ``.to("cpu")``.

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
STAGING_BYTES = 64 << 20
_HOST_BLOCKS: dict[tuple, torch.Tensor] = {}


_shipped_to_host = host_copies.HostCopier._to_host
_shipped_land = host_copies.HostCopy.land


def _to_host_variants(copy: host_copies.HostCopy, stream: torch.cuda.Stream) -> torch.Tensor:
    """HostCopier._to_host with the variants above, chosen per copy from MODE."""
    mode = MODE["name"]
    if mode == "no_transfer":
        copy.event.synchronize()
        key = (tuple(copy.block.shape), copy.block.dtype)
        if key not in _HOST_BLOCKS:
            _HOST_BLOCKS[key] = torch.zeros(copy.block.shape, dtype=copy.block.dtype)
        return _HOST_BLOCKS[key]
    if mode.startswith("staging"):
        return _through_staging(copy, stream, poll=mode == "staging_poll")
    return _shipped_to_host(copy, stream)


def _land_variants(self: host_copies.HostCopy, host: torch.Tensor) -> None:
    if MODE["name"] != "no_split":
        return _shipped_land(self, host)
    self.parts = [host[:, start:stop] for start, stop in self.splits]
    self.block = self.event = None
    self._done.set()


def _through_staging(copy: host_copies.HostCopy, stream: torch.cuda.Stream, poll: bool) -> torch.Tensor:
    if "staging" not in _HOST_BLOCKS:
        _HOST_BLOCKS["staging"] = torch.empty(STAGING_BYTES, dtype=torch.uint8, pin_memory=True)
    staging = _HOST_BLOCKS["staging"]
    host = torch.empty(copy.block.shape, dtype=copy.block.dtype)
    source, target = copy.block.reshape(-1).view(torch.uint8), host.view(-1).view(torch.uint8)
    stream.wait_event(copy.event)
    for start in range(0, copy.nbytes, STAGING_BYTES):
        size = min(STAGING_BYTES, copy.nbytes - start)
        with torch.cuda.stream(stream):
            staging[:size].copy_(source[start : start + size], non_blocking=True)
            landed = torch.cuda.Event()
            landed.record()
        if poll:
            while not landed.query():
                time.sleep(0.0002)
        else:
            landed.synchronize()
        target[start : start + size].copy_(staging[:size])
    return host


_shipped_submit = host_copies.HostCopier.submit


def _submit_variants(self: host_copies.HostCopier, block: torch.Tensor, splits: list[tuple[int, int]]):
    if MODE["name"] != "no_thread":
        return _shipped_submit(self, block, splits)
    key = (tuple(block.shape), block.dtype)
    if key not in _HOST_BLOCKS:
        _HOST_BLOCKS[key] = torch.zeros(block.shape, dtype=block.dtype)
    copy = host_copies.HostCopy(splits)
    copy.parts = [_HOST_BLOCKS[key][:, start:stop] for start, stop in splits]
    copy._done.set()
    return copy


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
                        default="plain,full,no_split,no_transfer,switch_interval,staging_poll,staging_sync")
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
