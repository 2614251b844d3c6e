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
table gives vllm-interp's own functions on the forward thread (the one that ran the most operators): each one's
time per step without its callees (self) and with them (total; a runner mixin's method wraps vLLM's).
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


def profiler_args(directory: Path, with_stack: bool = False, skip: int = SKIP_STEPS,
                  window: int = WINDOW_STEPS) -> list[str]:
    """`vllm serve` arguments for a torch profiler over ``window`` steps, ``skip`` steps after each start,
    writing under ``directory``; ``with_stack``: Python calls recorded too."""
    config = {"profiler": "torch", "torch_profiler_dir": str(directory), "torch_profiler_with_stack": with_stack,
              "ignore_frontend": True, "delay_iterations": skip, "max_iterations": window}
    return ["--profiler-config", json.dumps(config)]


def post(url: str, path: str) -> None:
    request = urllib.request.Request(f"{url}{path}", data=b"", method="POST")
    with urllib.request.urlopen(request, timeout=600) as response:
        response.read()


def traces_since(directory: Path, since: float) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.stat().st_mtime >= since
                  and (p.name.endswith(".json") or p.name.endswith(".json.gz")))


def span_note(spans: list[float], busy_total: float, window: int = WINDOW_STEPS) -> str:
    """The window's wall time per step on the device's clock, and the busy share of it: a step whose device
    busy time is unchanged but whose span grew lost the difference on the host."""
    if not spans:
        return ""
    span = sum(spans) / len(spans)
    return f"; span {span / window:.0f} us per step, busy {busy_total / len(spans) / span:.2f} of it"


def python_self_and_total(events: list[dict], self_time: Counter[str], total_time: Counter[str]) -> None:
    """Add the forward thread's vllm-interp Python calls in ``events`` to ``self_time`` (without callees) and
    ``total_time`` (with them), by function."""
    work: Counter = Counter()
    for event in events:
        if event.get("ph") == "X" and event.get("cat") == "cpu_op":
            work[event.get("tid")] += event.get("dur", 0)
    if not work:
        return
    forward = work.most_common(1)[0][0]
    calls = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") == "python_function"
                    and e.get("tid") == forward), key=lambda e: (e.get("ts", 0), -e.get("dur", 0)))
    open_calls: list[list] = []  # [end, name, time of direct callees, duration]

    def close(call: list) -> None:
        _, name, callees, duration = call
        if "vllm_interp/" in name:
            key = name.split("vllm_interp/", 1)[1][:90]
            self_time[key] += duration - callees
            total_time[key] += duration

    for event in calls:
        start, duration = event.get("ts", 0), event.get("dur", 0)
        while open_calls and open_calls[-1][0] <= start:
            close(open_calls.pop())
        if open_calls:
            open_calls[-1][2] += duration
        open_calls.append([start + duration, event.get("name", ""), 0, duration])
    for call in reversed(open_calls):
        close(call)


def summarise(traces: list[Path], label: str, window: int = WINDOW_STEPS) -> str:
    """The device's busy time per profiled step in ``traces`` (of ``window`` steps), and its largest items, as
    Markdown."""
    if not traces:
        return f"### {label}\n\nno trace was written\n"
    busy: Counter[str] = Counter()
    cpu_ops: Counter[str] = Counter()
    host_calls: Counter[str] = Counter()
    host_time: Counter[str] = Counter()
    host_longest: Counter[str] = Counter()
    ours_self: Counter[str] = Counter()  # vllm-interp's Python functions, by "file(line): name"
    ours_total: Counter[str] = Counter()
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
            elif event.get("cat") in HOST_CATEGORIES:
                name = event.get("name", "?")[:90]
                host_calls[name] += 1
                host_time[name] += event.get("dur", 0)
                host_longest[name] = max(host_longest[name], event.get("dur", 0))
        python_self_and_total(events, ours_self, ours_total)
        if device_times:
            spans.append(max(end for _, end in device_times) - min(start for start, _ in device_times))
    what, items = ("device", busy) if busy else ("CPU operators (no device events)", cpu_ops)
    total = sum(items.values())
    lines = [f"### {label}", "", f"{len(traces)} trace(s); {what}: {total / window:.0f} us per profiled step "
             f"({window} steps)" + span_note(spans, total, window), "", "| item | us per step | share |",
             "|---|---|---|"]
    for name, duration in items.most_common(TOP_ITEMS):
        lines.append(f"| `{name}` | {duration / window:.1f} | {duration / total:.3f} |")
    if host_time:
        lines += ["", f"Host: CUDA calls, {sum(host_time.values()) / window:.0f} us per step", "",
                  "| call | calls per step | us per step | longest us |", "|---|---|---|---|"]
        for name, duration in host_time.most_common(TOP_ITEMS):
            lines.append(f"| `{name}` | {host_calls[name] / window:.1f} | {duration / window:.1f} | "
                         f"{host_longest[name]:.0f} |")
    if ours_self:
        own = sum(ours_self.values()) / window
        lines += ["", f"Host: vllm-interp's Python on the forward thread, {own:.0f} us per step (self)", "",
                  "| function | self us per step | total us per step |", "|---|---|---|"]
        lines += [f"| `{name}` | {duration / window:.1f} | {ours_total[name] / window:.1f} |"
                  for name, duration in ours_self.most_common(TOP_ITEMS)]
    return "\n".join(lines) + "\n"
