"""Which runner mixin a worker's model runner takes: V1 (``runner_v1.py``) or V2 (``runner_v2.py``).

vLLM 0.26 picks its runner per model and platform (V2 for dense models on GPUs, V1 elsewhere, and
``VLLM_USE_V2_MODEL_RUNNER`` overrides it); vllm-interp hooks whichever it picked. Each runner's
touchpoints are checked before the model loads, its live attributes right after.
"""

from dataclasses import dataclass
from functools import cache
from typing import Any

from vllm_interp.engine.touchpoints import Touchpoint, check_attributes
from vllm_interp.engine.v0_26.steps import InterpSteps


@dataclass(frozen=True)
class RunnerHooks:
    name: str  # "V1" or "V2"
    mixin: type[InterpSteps]
    touchpoints: tuple[Touchpoint, ...]
    attributes: dict[str, str]

    def install(self, runner: Any) -> None:
        """Swap the runner's class for one with the mixin (the caller then attaches the tables)."""
        check_attributes(runner, f"{self.name} GPUModelRunner", self.attributes)
        runner.__class__ = _with_mixin(self.mixin, type(runner))


def hooks_for(runner: Any) -> RunnerHooks:
    """The hooks for this live model runner; an error naming it if vllm-interp hooks neither runner."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner as V1Runner

    from vllm_interp.engine.v0_26 import runner_v1

    if isinstance(runner, V1Runner):
        return RunnerHooks("V1", runner_v1.InterpV1RunnerMixin, runner_v1.TOUCHPOINTS, runner_v1.ATTRIBUTES)
    # Imported only here: a V1 engine (the CPU one) need not load the V2 runner's modules.
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2Runner

    from vllm_interp.engine.v0_26 import runner_v2

    if isinstance(runner, V2Runner):
        return RunnerHooks("V2", runner_v2.InterpV2RunnerMixin, runner_v2.TOUCHPOINTS, runner_v2.ATTRIBUTES)
    raise RuntimeError(f"vllm-interp hooks vLLM's V1 and V2 model runners; this worker runs "
                       f"{type(runner).__module__}.{type(runner).__name__}")


@cache
def _with_mixin(mixin: type, base: type) -> type:
    return type(f"Interp{base.__name__}", (mixin, base), {})


def all_touchpoints() -> tuple[Touchpoint, ...]:
    from vllm_interp.engine.v0_26 import runner_v1, runner_v2

    return (*runner_v1.TOUCHPOINTS, *runner_v2.TOUCHPOINTS)
