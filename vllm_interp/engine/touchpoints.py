"""Start-up checks of what vllm-interp relies on inside vLLM: each touchpoint names one internal and why.

A touchpoint is a dotted target (``module:Attr.attr``) with the use vllm-interp makes of it (``override``,
``call``, ``patch``, ``read``, ``env``), a one-line reason, and for callables the parameters it passes or
receives by name. ``check_touchpoints`` resolves every target and compares parameters; ``check_attributes``
does the same for attributes that exist only on a live object (the model runner's batch state). Either
raises ``VllmInternalsMismatch`` listing every mismatch with its reason, so an engine never starts unhooked,
hooked in the wrong place, or with a prefix-cache key that no longer forks.
"""

import importlib
import inspect
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

Use = Literal["override", "call", "patch", "read", "env"]
_VERBS = {"override": "overrides", "call": "calls", "patch": "patches", "read": "reads", "env": "sets"}


class VllmInternalsMismatch(RuntimeError):
    pass


@dataclass(frozen=True)
class Touchpoint:
    target: str  # "vllm.v1.worker.gpu_model_runner:GPUModelRunner._model_forward"; "env:NAME" for a flag
    use: Use
    reason: str
    params: tuple[str, ...] = ()  # parameters vllm-interp passes or reads by name

    def problem(self) -> str | None:
        """Why this touchpoint does not hold on the installed vLLM, or None."""
        try:
            found = _resolve(self.target)
        except (ImportError, AttributeError) as exc:
            return f"{self.target}: missing ({exc})"
        if self.params:
            try:
                names = set(inspect.signature(found).parameters)
            except (TypeError, ValueError):
                return f"{self.target}: not a callable with a signature"
            if missing := [p for p in self.params if p not in names]:
                return f"{self.target}: no parameter {', '.join(missing)}"
        return None


def _resolve(target: str) -> Any:
    module_name, _, path = target.partition(":")
    if module_name == "env":
        import vllm.envs

        if path not in vllm.envs.environment_variables:
            raise AttributeError(f"vllm.envs does not know {path}")
        return path
    found: Any = importlib.import_module(module_name)
    for part in filter(None, path.split(".")):
        found = getattr(found, part)
    return found


def check_touchpoints(touchpoints: Iterable[Touchpoint]) -> None:
    """Raise ``VllmInternalsMismatch`` naming every touchpoint that does not hold."""
    problems = [(p, t) for t in touchpoints if (p := t.problem()) is not None]
    if problems:
        _fail([f"{problem} (vllm-interp {_VERBS[t.use]} it: {t.reason})" for problem, t in problems])


def check_attributes(obj: Any, what: str, attributes: dict[str, str]) -> None:
    """``attributes``: dotted attribute path on ``obj`` -> why vllm-interp reads it."""
    problems = []
    for path, reason in attributes.items():
        found = obj
        try:
            for part in path.split("."):
                found = getattr(found, part)
        except AttributeError:
            problems.append(f"{what}.{path}: missing on {type(obj).__name__} (vllm-interp reads it: {reason})")
    if problems:
        _fail(problems)


def _fail(problems: list[str]) -> None:
    import vllm

    lines = "\n".join(f"  - {p}" for p in problems)
    raise VllmInternalsMismatch(
        f"vllm-interp cannot hook this vLLM ({vllm.__version__}): internals it relies on have changed:\n{lines}")
