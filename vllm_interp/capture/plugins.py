"""Finding and configuring capture consumers: the ``vllm_interp.capture_consumers`` entry-point group.

``--capture-consumers NAME[:key=val,...]`` enables a consumer. Three options belong to the engine rather
than the consumer and apply to every one: ``queue_mb`` (the consumer's queue bound, default 256),
``spill_dir`` (where the ``spill`` overload policy parks rows; default a temporary directory) and
``isolation`` (``thread`` or ``process``: where the consumer's code runs, see ``isolation.py``; default the
consumer class's ``default_isolation``). The rest go to the consumer's ``validate_engine_options``.
"""

from dataclasses import dataclass
from functools import cache
from importlib.metadata import entry_points
from typing import Any

from vllm_interp.capture.consumer import CaptureConsumer
from vllm_interp.capture.isolation import ISOLATIONS, Isolation
from vllm_interp.config import parse_consumer_spec

CAPTURE_CONSUMER_GROUP = "vllm_interp.capture_consumers"
DEFAULT_QUEUE_MB = 256


@dataclass(frozen=True)
class ConsumerSetup:
    name: str
    cls: type[CaptureConsumer]
    options: dict[str, Any]
    queue_bytes: int
    spill_dir: str | None
    isolation: Isolation


@cache
def installed_consumers() -> dict[str, Any]:
    return {ep.name: ep for ep in entry_points(group=CAPTURE_CONSUMER_GROUP)}


def consumer_class(name: str) -> type[CaptureConsumer]:
    installed = installed_consumers()
    if name not in installed:
        raise ValueError(
            f"--capture-consumers: unknown consumer {name!r}; installed ({CAPTURE_CONSUMER_GROUP}): "
            f"{', '.join(sorted(installed)) or 'none'}"
        )
    cls = installed[name].load()
    if not (isinstance(cls, type) and issubclass(cls, CaptureConsumer)):
        raise ValueError(f"--capture-consumers: {name!r} is not a vllm_interp CaptureConsumer subclass")
    return cls


def configure_consumers(specs: tuple[str, ...]) -> dict[str, ConsumerSetup]:
    """Parse and validate every ``--capture-consumers`` flag; errors name the consumer and option."""
    setups: dict[str, ConsumerSetup] = {}
    for spec in specs:
        name, options = parse_consumer_spec(spec)
        if name in setups:
            raise ValueError(f"--capture-consumers: {name!r} is enabled twice")
        cls = consumer_class(name)
        queue_mb = _positive_int(options.pop("queue_mb", str(DEFAULT_QUEUE_MB)),
                                 f"--capture-consumers {name}: queue_mb")
        spill_dir = options.pop("spill_dir", None)
        isolation = options.pop("isolation", cls.default_isolation)
        if isolation not in ISOLATIONS:
            raise ValueError(f"--capture-consumers {name}: isolation: expected one of {', '.join(ISOLATIONS)}, "
                             f"got {isolation!r}")
        try:
            validated = cls.validate_engine_options(options)
        except ValueError as exc:
            raise ValueError(f"--capture-consumers {name}: {exc}") from None
        setups[name] = ConsumerSetup(name, cls, validated, queue_mb << 20, spill_dir, isolation)
    return setups


def _positive_int(text: str, field: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{field}: expected a positive integer, got {text!r}")
    return value
