"""The capture-size bound: refuse at admission a capture spec whose rows could exceed a byte budget.

A request's captured rows are held on the worker until it finishes (and, for ``inline``, travel back in the
response), so their size is bounded before the request runs. The bound is a worst case: for each consumer,
the positions its spec may select x its sites x the row's width x 4 bytes (fp32, the widest dtype rows are
kept in), summed over consumers; a row is ``hidden_size`` wide, or the width of the summary a consumer with a
``row_reduction`` takes instead. Positions are counted within the longest sequence the request can reach:
``prompt_len + max_tokens``, capped at ``max_model_len``; an unknown prompt length or ``max_tokens`` counts as
``max_model_len`` (the most vLLM admits). Every front door calls :func:`check_capture_bytes` with what it
knows at admission, and a way to count a text prompt's tokens if it has one.
"""

from collections.abc import Callable, Mapping

from vllm_interp.capture.consumer import CaptureConsumer
from vllm_interp.capture.spec import CaptureSpecError, ConsumerSpec

FP32_BYTES = 4


def worst_case_positions(entry: ConsumerSpec, *, prompt_len: int | None, max_tokens: int | None,
                         max_model_len: int) -> int:
    """The most positions ``entry`` can select in a sequence of at most ``prompt_len + max_tokens`` tokens."""
    prompt = max_model_len if prompt_len is None else min(prompt_len, max_model_len)
    generated = max_model_len if max_tokens is None else max_tokens
    length = min(max_model_len, prompt + generated)
    match entry.positions:
        case "all":
            return length
        case "all_prompt":
            return prompt
        case "last_prompt":
            return 1
        case "all_generated":
            # With the prompt length unknown, the generated part is bounded by max_tokens alone.
            return length - prompt if prompt_len is not None else min(length, generated)
        case explicit:
            return sum(1 for position in explicit if position < length)


def row_width(consumer: type[CaptureConsumer], hidden_size: int) -> int:
    """How many values of each row ``consumer`` receives."""
    return consumer.row_reduction.width if consumer.row_reduction is not None else hidden_size


def capture_bytes(spec: Mapping[str, ConsumerSpec], *, consumers: Mapping[str, type[CaptureConsumer]],
                  num_layers: int, hidden_size: int, prompt_len: int | None, max_tokens: int | None,
                  max_model_len: int) -> dict[str, int]:
    """Worst-case bytes of the rows each consumer of ``spec`` receives."""
    return {
        name: worst_case_positions(entry, prompt_len=prompt_len, max_tokens=max_tokens, max_model_len=max_model_len)
        * len(entry.sites(num_layers)) * row_width(consumers[name], hidden_size) * FP32_BYTES
        for name, entry in spec.items()
    }


def check_capture_bytes(spec: Mapping[str, ConsumerSpec], *, consumers: Mapping[str, type[CaptureConsumer]],
                        num_layers: int, hidden_size: int, max_tokens: int | None, max_model_len: int, limit: int,
                        prompt_len: int | None = None, count_prompt: Callable[[], int] | None = None,
                        field: str = "capture") -> None:
    """Raise a ``CaptureSpecError`` naming ``<field>.<consumer>`` (the largest) when the worst-case bytes of
    all consumers together exceed ``limit`` (``--max-capture-bytes-per-request``).

    ``prompt_len`` is the prompt's length in tokens when the caller has it; otherwise ``count_prompt`` (say,
    tokenizing a text prompt) is called, only when the bound fails without the length."""
    sizes = capture_bytes(spec, consumers=consumers, num_layers=num_layers, hidden_size=hidden_size,
                          prompt_len=prompt_len, max_tokens=max_tokens, max_model_len=max_model_len)
    total = sum(sizes.values())
    if total <= limit:
        return
    if prompt_len is None and count_prompt is not None:
        check_capture_bytes(spec, consumers=consumers, num_layers=num_layers, hidden_size=hidden_size,
                            max_tokens=max_tokens, max_model_len=max_model_len, limit=limit,
                            prompt_len=count_prompt(), field=field)
        return
    largest = max(sizes, key=sizes.__getitem__)
    entry = spec[largest]
    positions = worst_case_positions(entry, prompt_len=prompt_len, max_tokens=max_tokens,
                                     max_model_len=max_model_len)
    known = "unknown" if prompt_len is None else str(prompt_len)
    raise CaptureSpecError(
        f"{field}.{largest}: up to {total} bytes of rows for this request ({largest}: {positions} positions x "
        f"{len(entry.sites(num_layers))} sites x {row_width(consumers[largest], hidden_size)} x {FP32_BYTES} bytes "
        f"= {sizes[largest]}; prompt length {known}, max_tokens {max_tokens if max_tokens is not None else 'unset'}, "
        f"max_model_len {max_model_len}), more than the {limit} bytes allowed (--max-capture-bytes-per-request); "
        "capture fewer sites or positions, or set max_tokens"
    )
