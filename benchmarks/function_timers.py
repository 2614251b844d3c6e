"""Time named engine functions in place, in whichever process runs them: the milliseconds and calls each one
takes, so a per-request cost shows as scheduling, request admission, the runner's step or vllm-interp's plan.

Offline (``steer_admission --split``) the engine core is in the benchmark's process: ``time_functions`` wraps
``FUNCTIONS`` there. Served (``serve.py --function-timers``) it is a process of its own, in plain vLLM and in
vllm-interp alike: ``write_plugin`` makes this module a vLLM general plugin (vLLM loads general plugins in every
engine core), which wraps the same functions when ``TIMERS_DIR`` names a directory and writes the process's
running totals there as ``PID.json`` every ``WRITE_EVERY_S``; ``read_totals`` sums a server's files.
"""

import functools
import json
import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from importlib import import_module
from pathlib import Path

# "module:Class.method" or "module:function", as the caller looks it up (a name missing here is left out).
FUNCTIONS = (
    "vllm.v1.engine.core:EngineCore.preprocess_add_request",  # served: on the engine core's input thread
    "vllm.v1.engine.core:EngineCore.add_request",
    "vllm.v1.core.sched.scheduler:Scheduler.schedule",
    "vllm.v1.core.sched.scheduler:Scheduler.update_from_output",
    "vllm.v1.executor.uniproc_executor:UniProcExecutor.execute_model",
    "vllm.v1.executor.uniproc_executor:UniProcExecutor.sample_tokens",
    "vllm.v1.executor.multiproc_executor:MultiprocExecutor.execute_model",  # a worker process (the CPU build)
    "vllm.v1.worker.gpu.model_runner:GPUModelRunner.add_requests",
    "vllm.v1.worker.gpu.model_runner:GPUModelRunner.prepare_inputs",
    "vllm.model_executor.models.llama:LlamaForCausalLM.forward",
    "vllm_interp.engine.v0_26.steps:InterpSteps._interp_admit",
    "vllm_interp.engine.v0_26.steps:InterpSteps._interp_plan",
    "vllm_interp.steering.tables:SteeringTables.step_index",
    "vllm_interp.steering.tables:SteeringTables.load_index",
    "vllm_interp.steering.tables:SteeringTables.upload_pending",
    "vllm_interp.steering.tables:SteeringTables.lookup",
    "vllm_interp.steering.tables:SteeringTables._sites_of",
    "vllm_interp.steering.tables:rows_to_device",
    "vllm_interp.steering.tables:to_device",
    "vllm_interp.steering.tables:copy_into",
    "vllm_interp.engine.v0_26.steps:InterpSteps._interp_collect",
)
FORWARD = "LlamaForCausalLM.forward"  # its calls count a run's steps
TIMERS_DIR = "BENCH_FUNCTION_TIMERS"  # the environment variable that turns the plugin on
PLUGIN = "bench_function_timers"  # its name among vLLM's general plugins (for ``VLLM_PLUGINS``)
WRITE_EVERY_S = 0.2

Totals = dict[str, list[float]]  # label ("Class.method") -> [seconds, calls]
_installed = False


def label_of(name: str) -> str:
    return name.partition(":")[2]


def time_functions(names: tuple[str, ...] = FUNCTIONS) -> Totals:
    """Wrap each named function in place with a timer; returns the running totals by label (the caller may
    clear them). The wrappers keep each function's signature: vllm-interp's start-up checks read them."""
    totals: Totals = defaultdict(lambda: [0.0, 0])
    for name in names:
        module_name, _, path = name.partition(":")
        owner_name, _, attribute = path.rpartition(".")
        try:
            module = import_module(module_name)
            owner = getattr(module, owner_name) if owner_name else module
            original = owner.__dict__[attribute]
        except (ImportError, AttributeError, KeyError):
            continue

        @functools.wraps(original)
        def timed(*args, _original: Callable = original, _label: str = path, **kwargs):
            start = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                total = totals[_label]
                total[0] += time.perf_counter() - start
                total[1] += 1

        setattr(owner, attribute, timed)
    return totals


def install() -> None:
    """The general plugin: in a process whose environment names ``TIMERS_DIR``, time ``FUNCTIONS`` and keep
    ``DIR/PID.json`` up to date (once per process: vLLM may load plugins more than once)."""
    global _installed
    directory = os.environ.get(TIMERS_DIR)
    if not directory or _installed:
        return
    _installed = True
    # vllm-interp's functions only where vLLM loads vllm-interp too: plain vLLM's engine stays without its modules.
    allowed = os.environ.get("VLLM_PLUGINS")
    with_interp = allowed is None or "vllm_interp" in allowed.split(",")
    totals = time_functions(tuple(name for name in FUNCTIONS if with_interp or not name.startswith("vllm_interp")))
    path = Path(directory) / f"{os.getpid()}.json"

    def write() -> None:
        while True:
            time.sleep(WRITE_EVERY_S)
            if totals:
                partial = path.with_suffix(".tmp")
                partial.write_text(json.dumps(dict(totals)))
                partial.replace(path)

    threading.Thread(target=write, name="function-timers", daemon=True).start()


def write_plugin(target: Path) -> Path:
    """Make this module visible to vLLM as a general plugin: distribution metadata in ``target`` (put it and
    the repository root on the servers' PYTHONPATH)."""
    dist_info = target / f"{PLUGIN}-0.dist-info"
    dist_info.mkdir(parents=True, exist_ok=True)
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {PLUGIN}\nVersion: 0\n")
    (dist_info / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{PLUGIN} = {__name__}:install\n")
    return target


def read_totals(directory: Path) -> Totals:
    """The summed totals of every process that wrote into ``directory``."""
    summed: Totals = defaultdict(lambda: [0.0, 0])
    for path in directory.glob("*.json"):
        try:
            totals = json.loads(path.read_text())
        except (OSError, ValueError):  # replaced while read: the next read has it
            continue
        for label, (seconds, calls) in totals.items():
            summed[label][0] += seconds
            summed[label][1] += calls
    return dict(summed)


def difference(after: Totals, before: Totals) -> Totals:
    return {label: [seconds - before.get(label, [0.0, 0])[0], calls - before.get(label, [0.0, 0])[1]]
            for label, (seconds, calls) in after.items()}
