"""Where a serving engine's steps spend device time: vLLM's torch profiler over a window of steps, summarised.

A server started with ``profiler_args(directory)`` profiles ``WINDOW_STEPS`` engine steps, ``SKIP_STEPS`` after
each ``POST /start_profile`` (past a phase's prefill, into its decode), and writes a trace per worker when
``POST /stop_profile`` comes. ``summarise`` reads the traces written since a phase started and returns a
Markdown table: the device's busy time per profiled step (kernels, copies and sets, from the traces' GPU
events; on a CPU engine, whose traces hold none, the CPU operators' time, a nested operator's counted in its
parent's too) and the items that took most of it. Comparing a capturing phase's table with the plain
phase's shows what capture adds to a step on the device, which host-side sampling (py-spy) cannot see. A
second table gives the host's side of the same steps: the CUDA runtime calls the forward thread made (count,
time and longest call per step), where a call that waits for the device (a synchronize, a copy into pageable
memory) or a slowed launch shows. With Python calls recorded (``profiler_args(..., with_stack=True)``), a third
table gives vllm-interp's own functions' time per step (each call's whole duration, callees included).
"""

import gzip
import json
import urllib.request
from collections import Counter
from pathlib import Path

WINDOW_STEPS = 40
SKIP_STEPS = 30
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATEGORIES = ("cuda_runtime", "cuda_driver")
TOP_ITEMS = 12


def profiler_args(directory: Path, with_stack: bool = False) -> list[str]:
    """`vllm serve` arguments for a torch profiler over a window of steps, writing under ``directory``;
    ``with_stack``: Python calls recorded too."""
    config = {"profiler": "torch", "torch_profiler_dir": str(directory), "torch_profiler_with_stack": with_stack,
              "ignore_frontend": True, "delay_iterations": SKIP_STEPS, "max_iterations": WINDOW_STEPS}
    return ["--profiler-config", json.dumps(config)]


def post(url: str, path: str) -> None:
    request = urllib.request.Request(f"{url}{path}", data=b"", method="POST")
    with urllib.request.urlopen(request, timeout=600) as response:
        response.read()


def traces_since(directory: Path, since: float) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.stat().st_mtime >= since
                  and (p.name.endswith(".json") or p.name.endswith(".json.gz")))


def span_note(spans: list[float], busy_total: float) -> str:
    """The window's wall time per step on the device's clock, and the busy share of it: a step whose device
    busy time is unchanged but whose span grew lost the difference on the host."""
    if not spans:
        return ""
    span = sum(spans) / len(spans)
    return f"; span {span / WINDOW_STEPS:.0f} us per step, busy {busy_total / len(spans) / span:.2f} of it"


def summarise(traces: list[Path], label: str) -> str:
    """The device's busy time per profiled step in ``traces``, and its largest items, as Markdown."""
    if not traces:
        return f"### {label}\n\nno trace was written\n"
    busy: Counter[str] = Counter()
    cpu_ops: Counter[str] = Counter()
    host_calls: Counter[str] = Counter()
    host_time: Counter[str] = Counter()
    host_longest: Counter[str] = Counter()
    ours: Counter[str] = Counter()  # vllm-interp's Python functions, by "file(line): name"
    spans: list[float] = []  # each trace's first device event's start to its last one's end, us
    for trace in traces:
        opener = gzip.open if trace.name.endswith(".gz") else open
        with opener(trace, "rt") as f:
            events = json.load(f).get("traceEvents", [])
        device_times = []
        for event in events:
            if event.get("ph") != "X":
                continue
            if event.get("cat") in DEVICE_CATEGORIES:
                busy[event.get("name", "?")[:90]] += event.get("dur", 0)
                device_times.append((event.get("ts", 0), event.get("ts", 0) + event.get("dur", 0)))
            elif event.get("cat") == "cpu_op":
                cpu_ops[event.get("name", "?")[:90]] += event.get("dur", 0)
            elif event.get("cat") == "python_function" and "vllm_interp/" in event.get("name", ""):
                ours[event["name"].split("vllm_interp/", 1)[1][:90]] += event.get("dur", 0)
            elif event.get("cat") in HOST_CATEGORIES:
                name = event.get("name", "?")[:90]
                host_calls[name] += 1
                host_time[name] += event.get("dur", 0)
                host_longest[name] = max(host_longest[name], event.get("dur", 0))
        if device_times:
            spans.append(max(end for _, end in device_times) - min(start for start, _ in device_times))
    what, items = ("device", busy) if busy else ("CPU operators (no device events)", cpu_ops)
    total = sum(items.values())
    lines = [f"### {label}", "", f"{len(traces)} trace(s); {what}: {total / WINDOW_STEPS:.0f} us per profiled step "
             f"({WINDOW_STEPS} steps)" + span_note(spans, total), "", "| item | us per step | share |", "|---|---|---|"]
    for name, duration in items.most_common(TOP_ITEMS):
        lines.append(f"| `{name}` | {duration / WINDOW_STEPS:.1f} | {duration / total:.3f} |")
    if host_time:
        lines += ["", f"Host: CUDA calls, {sum(host_time.values()) / WINDOW_STEPS:.0f} us per step", "",
                  "| call | calls per step | us per step | longest us |", "|---|---|---|---|"]
        for name, duration in host_time.most_common(TOP_ITEMS):
            lines.append(f"| `{name}` | {host_calls[name] / WINDOW_STEPS:.1f} | {duration / WINDOW_STEPS:.1f} | "
                         f"{host_longest[name]:.0f} |")
    if ours:
        lines += ["", "Host: vllm-interp's Python functions (callees included)", "", "| function | us per step |",
                  "|---|---|"]
        lines += [f"| `{name}` | {duration / WINDOW_STEPS:.1f} |" for name, duration in ours.most_common(TOP_ITEMS)]
    return "\n".join(lines) + "\n"
