"""What the site kernels add to a replayed CUDA graph when no row is named (an enabled but idle engine).

    python -m benchmarks.site_kernel_replay [--sites 48] [--hidden 2048] [--tokens 1,128,256] [--replays 2000]

Every hook site of a model replays one site kernel per step (site_kernel.py) whether or not a request uses a
feature. This captures ``--sites`` launches over a ``[tokens, hidden]`` bf16 stream pair with idle buffers
(steering, patching and reads compiled in, nothing named), and the same graph with a ``--sites``-long chain of
``--filler`` matmuls alone and with the kernels between them, then times replays: the difference is the
kernels' cost per step, printed per kernel and per step. Needs CUDA.
"""

import argparse

import torch

from vllm_interp.config import DEFAULT_MAX_STEERING_CONFIGS
from vllm_interp.models.site_kernel import site_in_graph
from vllm_interp.steering.tables import table_rows

GRAPH_READ_ROWS = 512  # the sites' read buffers by default: vLLM 0.26's largest CUDA graph


def _graph(body) -> torch.cuda.CUDAGraph:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        body()  # warm-up: Triton compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    return graph


def _replay_us(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    for _ in range(20):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / replays


def step_us(tokens: int, args: argparse.Namespace, with_sites: bool) -> float:
    """One replay of ``--sites`` matmuls standing for the model, with an idle site kernel after each or not."""
    device, dtype = torch.device("cuda"), torch.bfloat16
    hidden = torch.randn(tokens, args.hidden, device=device, dtype=dtype)
    residual = torch.randn_like(hidden)
    steer_index = torch.zeros(tokens, dtype=torch.long, device=device)
    steer_table = torch.zeros(table_rows(DEFAULT_MAX_STEERING_CONFIGS), args.hidden, device=device, dtype=dtype)
    patch_index = torch.zeros(tokens, dtype=torch.long, device=device)
    patch_values = torch.zeros(2, args.hidden, device=device, dtype=dtype)
    patch_alpha = torch.zeros(2, device=device, dtype=dtype)
    read_slot = torch.full((tokens,), -1, dtype=torch.long, device=device)
    read_flag = torch.zeros(1, dtype=torch.int32, device=device)
    read_out = torch.zeros(GRAPH_READ_ROWS, args.hidden, device=device, dtype=dtype)
    x = torch.randn(tokens, args.filler, device=device, dtype=dtype)
    weight = torch.randn(args.filler, args.filler, device=device, dtype=dtype) / args.filler ** 0.5

    def model() -> None:
        y = x
        for _ in range(args.sites):
            y = y @ weight
            if with_sites:
                site_in_graph(hidden, residual, steer_index, steer_table, patch_index, patch_values, patch_alpha,
                              read_slot, read_flag, read_out, False)

    return _replay_us(_graph(model), args.replays)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sites", type=int, default=48)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--tokens", default="1,128,256")
    parser.add_argument("--replays", type=int, default=2000)
    parser.add_argument("--filler", type=int, default=2048, help="width of the matmuls standing for the model")
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}: {args.sites} site kernels, hidden {args.hidden}, bf16, nothing named")
    print("| tokens | matmuls alone us | with the kernels us | kernels us a step | us a kernel |")
    print("|---|---|---|---|---|")
    for tokens in map(int, args.tokens.split(",")):
        plain, sited = step_us(tokens, args, False), step_us(tokens, args, True)
        print(f"| {tokens} | {plain:.1f} | {sited:.1f} | {sited - plain:.1f} | {(sited - plain) / args.sites:.2f} |")


if __name__ == "__main__":
    main()
