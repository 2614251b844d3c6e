"""The forward thread's time per site call in a step that runs outside CUDA graphs (a prefill chunk).

    python -m benchmarks.eager_site_launch [--hidden 2048] [--tokens 64] [--calls 2000]

A served engine's prefill steps run the compiled model without graphs, so every hook site's op body runs in
Python on the forward thread, and a steered site launches its add there. This times, per call and on the host
alone (tokens few enough that the device keeps up): the site op with nothing planned at its site (an enabled but
idle engine), the op steering its site (today's eager path on CUDA: one launch of the site kernel), that kernel's
launch alone, and the same add as two torch calls (``index_select`` then ``add_``, the CPU's path). Without CUDA
it times the CPU's paths (a check of the script, not a figure to report).
"""

import argparse
import time
from collections.abc import Callable

import torch

from vllm_interp.models import site_ops
from vllm_interp.models.site_kernel import steer_in_place


def per_call_us(body: Callable[[], None], calls: int) -> float:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(50):
        body()
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        body()
    elapsed = time.perf_counter() - start
    sync()
    return elapsed / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device, dtype = torch.device("cuda" if cuda else "cpu"), torch.bfloat16
    hidden = torch.randn(args.tokens, args.hidden, device=device, dtype=dtype)
    residual = torch.randn_like(hidden)
    rows = 8
    table = torch.randn(1, 3, rows, args.hidden, device=device, dtype=dtype)  # [layers, hooks, rows, width]
    table[:, :, 0] = 0
    index = torch.randint(0, rows, (args.tokens,), device=device)
    patch_index = torch.zeros(3, args.tokens, dtype=torch.int64, device=device)
    patch_values = torch.zeros(1, args.hidden, device=device, dtype=dtype)
    patch_alpha = torch.zeros(1, device=device)
    read_slot = torch.full((args.tokens,), -1, dtype=torch.int64, device=device)
    read_flags = torch.zeros(3, dtype=torch.int32, device=device)
    read_out = torch.empty(3, 0, args.hidden, device=device, dtype=dtype)

    def op() -> None:
        site_ops.site(hidden, residual, index, table[0], patch_index, patch_values, patch_alpha, read_slot,
                      read_flags, read_out, 0, 2, False)

    results = {}
    site_ops.STEP.steer = frozenset()
    results["site op, nothing planned at the site"] = per_call_us(op, args.calls)
    site_ops.STEP.steer = frozenset({(0, 2)})
    results["site op steering its site"] = per_call_us(op, args.calls)
    site_ops.STEP.steer = frozenset()
    if cuda:
        results["site kernel launch alone"] = per_call_us(lambda: steer_in_place(residual, index, table[0, 2]),
                                                          args.calls)
    results["index_select + add_"] = per_call_us(
        lambda: residual.add_(table[0, 2].index_select(0, index[: residual.shape[0]])), args.calls)
    if cuda:
        results["torch.cuda.is_current_stream_capturing()"] = per_call_us(torch.cuda.is_current_stream_capturing,
                                                                           args.calls)
    card = torch.cuda.get_device_name() if cuda else "CPU"
    print(f"{card}: host us per call, {args.tokens} x {args.hidden} bf16, {args.calls} calls")
    for name, us in results.items():
        print(f"  {name}: {us:.1f}")


if __name__ == "__main__":
    main()
