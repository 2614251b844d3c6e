"""The capture spec: position keywords, sites, validation errors and the wire format (no engine)."""

import json
from typing import Any

import numpy as np
import pytest

from vllm_interp.capture.consumer import CaptureConsumer, EngineFacts
from vllm_interp.capture.consumers.inline import InlineConsumer
from vllm_interp.capture.spec import (
    MAX_TAG_LENGTH,
    CaptureSpecError,
    ConsumerSpec,
    spec_from_wire,
    spec_to_wire,
    validate_capture_spec,
)

NUM_LAYERS = 4


class LevelConsumer(CaptureConsumer):
    """Accepts one request option, ``level`` ('a' or 'b', any case), and fills in its default."""

    name = "levels"

    @classmethod
    def validate_options(cls, options: dict[str, Any], engine: EngineFacts) -> dict[str, Any]:
        for key in options:
            if key != "level":
                raise ValueError(f"{key}: unknown option")
        level = options.get("level", "a")
        if not isinstance(level, str) or level.lower() not in ("a", "b"):
            raise ValueError(f"level: must be 'a' or 'b' (got {level!r})")
        return {"level": level.lower()}


CONSUMERS = {"inline": InlineConsumer, "levels": LevelConsumer}


def validate(raw: Any, **kwargs: Any) -> dict[str, ConsumerSpec]:
    return validate_capture_spec(raw, engine=EngineFacts(NUM_LAYERS), consumers=CONSUMERS, **kwargs)


def spec_error(raw: Any, **kwargs: Any) -> str:
    with pytest.raises(CaptureSpecError) as info:
        validate(raw, **kwargs)
    return str(info.value)


# -- positions --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("positions", "expected"),
    [
        ("all", [0, 1, 2, 3, 4, 5, 6, 7]),
        ("all_prompt", [0, 1, 2, 3, 4]),
        ("last_prompt", [4]),
        ("all_generated", [5, 6, 7]),
        ([0, 6], [0, 6]),
        ([4, 20], [4]),  # a position the sequence never reaches selects nothing
    ],
)
def test_select(positions, expected):
    spec = ConsumerSpec(positions=positions)
    candidates = np.arange(8)
    assert candidates[spec.select(candidates, prompt_len=5)].tolist() == expected


def test_select_on_a_chunk():
    # Chunked prefill hands select() only the positions of one step, not the whole sequence.
    chunk = np.array([3, 4, 5])
    assert ConsumerSpec(positions="last_prompt").select(chunk, prompt_len=5).tolist() == [False, True, False]
    assert ConsumerSpec(positions="all_generated").select(chunk, prompt_len=5).tolist() == [False, False, True]
    assert ConsumerSpec(positions=[3, 5]).select(chunk, prompt_len=5).tolist() == [True, False, True]


@pytest.mark.parametrize(
    ("positions", "num_computed", "expected"),
    [
        ("all", 7, [0, 1, 2, 3, 4, 5, 6]),
        ("all_prompt", 7, [0, 1, 2, 3, 4]),
        ("all_prompt", 3, [0, 1, 2]),
        ("last_prompt", 7, [4]),
        ("last_prompt", 3, []),  # the prompt's last token was not computed yet
        ("all_generated", 7, [5, 6]),
        ("all_generated", 5, []),
        ([6, 1, 9], 7, [1, 6]),  # ascending, and 9 was never computed
    ],
)
def test_expected_positions(positions, num_computed, expected):
    spec = ConsumerSpec(positions=positions)
    assert spec.expected_positions(prompt_len=5, num_computed=num_computed).tolist() == expected


def test_default_positions_is_last_prompt():
    assert ConsumerSpec().positions == "last_prompt"
    assert validate({"inline": {}})["inline"].positions == "last_prompt"


@pytest.mark.parametrize(
    ("positions", "prompt_len", "expected"),
    [
        ("all", 5, True),
        ("all_prompt", 5, True),
        ("last_prompt", 5, False),
        ("all_generated", 5, False),
        ([0], 5, True),
        ([3], 5, True),
        ([3, 9], 5, True),
        ([4], 5, False),  # the last prompt token is always computed, even on a prefix-cache hit
        ([4, 7], 5, False),
        ([9], 5, False),
        ("all", 1, False),  # a one-token prompt has no prefix to miss
        ("all_prompt", 1, False),
    ],
)
def test_needs_prompt_prefix(positions, prompt_len, expected):
    assert ConsumerSpec(positions=positions).needs_prompt_prefix(prompt_len) is expected


# -- sites --------------------------------------------------------------------------------------------------


def test_sites_default_is_every_hook_of_every_layer():
    spec = ConsumerSpec()
    assert spec.hooks == "all"
    assert list(spec.sites(2)) == [
        (0, "pre_attn"),
        (0, "post_attn"),
        (0, "post_block"),
        (1, "pre_attn"),
        (1, "post_attn"),
        (1, "post_block"),
    ]
    assert spec.site_names(2) == [
        "0.pre_attn",
        "0.post_attn",
        "0.post_block",
        "1.pre_attn",
        "1.post_attn",
        "1.post_block",
    ]


def test_sites_are_layer_major_in_hook_order():
    # The request's dict order and layer-list order must not leak into the tensor order.
    spec = ConsumerSpec(hooks={"post_block": [3, 0], "pre_attn": [3], "post_attn": [0]})
    assert list(spec.sites(NUM_LAYERS)) == [(0, "post_attn"), (0, "post_block"), (3, "pre_attn"), (3, "post_block")]
    assert spec.site_names(NUM_LAYERS) == ["0.post_attn", "0.post_block", "3.pre_attn", "3.post_block"]


def test_sites_mix_all_and_lists():
    spec = ConsumerSpec(hooks={"post_attn": "all", "pre_attn": [1]})
    assert list(spec.sites(2)) == [(0, "post_attn"), (1, "pre_attn"), (1, "post_attn")]


def test_sites_sort_layers_numerically():
    # "10.post_block" sorts before "2.post_block" as text; sites are ordered by layer number.
    spec = ConsumerSpec(hooks={"post_block": [10, 2]})
    assert spec.site_names(12) == ["2.post_block", "10.post_block"]


def test_sites_after_validation():
    spec = validate({"inline": {"hooks": {"post_block": [2, 1], "pre_attn": "all"}}})["inline"]
    assert spec.site_names(NUM_LAYERS) == [
        "0.pre_attn",
        "1.pre_attn",
        "1.post_block",
        "2.pre_attn",
        "2.post_block",
        "3.pre_attn",
    ]


# -- errors name the field ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("hooks", "bad"),
    [
        ({"post_block": [0, 4]}, "[4]"),
        ({"pre_attn": [-1, 2, 7]}, "[-1, 7]"),
    ],
)
def test_layer_out_of_range(hooks, bad):
    hook = next(iter(hooks))
    message = spec_error({"inline": {"hooks": hooks}})
    assert message.startswith(f"capture.inline.hooks.{hook}: layers {bad} out of range")
    assert str(NUM_LAYERS) in message


def test_layer_out_of_range_names_the_consumer():
    message = spec_error({"inline": {}, "levels": {"hooks": {"post_attn": [9]}}})
    assert message.startswith("capture.levels.hooks.post_attn: layers [9] out of range")


def test_bad_hook_name():
    message = spec_error({"inline": {"hooks": {"mlp_out": [0]}}})
    assert message.startswith("capture.inline.hooks.mlp_out:")
    assert "post_block" in message  # says which hooks exist


@pytest.mark.parametrize("hooks", [{}, {"post_block": []}])
def test_empty_hooks(hooks):
    assert spec_error({"inline": {"hooks": hooks}}).startswith("capture.inline.hooks:")


def test_empty_spec():
    assert spec_error({}).startswith("capture: expected an object")


@pytest.mark.parametrize("raw", [[], [{"inline": {}}], "inline", None, 3])
def test_non_dict_spec(raw):
    assert spec_error(raw).startswith("capture: expected an object mapping consumer names to specs")


@pytest.mark.parametrize("entry", ["all", None, ["post_block"]])
def test_non_dict_consumer_entry(entry):
    assert spec_error({"inline": entry}).startswith("capture.inline:")


def test_field_prefix():
    message = spec_error({"inline": {"hooks": {"post_block": [8]}}}, field="capture_global")
    assert message.startswith("capture_global.inline.hooks.post_block: layers [8]")


def test_unknown_consumer_lists_enabled_ones():
    message = spec_error({"filesystem": {}})
    assert message.startswith("capture.filesystem: consumer not enabled")
    assert "(enabled: inline, levels)" in message


def test_unknown_consumer_with_none_enabled():
    with pytest.raises(CaptureSpecError, match=r"\(enabled: none\)"):
        validate_capture_spec({"inline": {}}, engine=EngineFacts(NUM_LAYERS), consumers={})


@pytest.mark.parametrize(
    ("positions", "why"),
    [
        ([1, 2, 1], "repeat"),
        ([3, -1], "[0, 2147483648)"),
        ([], "empty"),
        ("first", ""),
        ("last_generated", ""),
    ],
)
def test_bad_positions(positions, why):
    message = spec_error({"inline": {"positions": positions}})
    assert message.startswith("capture.inline.positions:")
    assert why in message


@pytest.mark.parametrize("tag", ["../x", "/abs", "a/../b", ".hidden", "a/./b", "a//b", "a/", "", "a b", "a\\b"])
def test_tag_rejected(tag):
    assert spec_error({"inline": {"tag": tag}}).startswith("capture.inline.tag:")


def test_tag_too_long():
    tag = "/".join(["a" * 100] * 3)  # every segment is fine; the whole is not
    assert len(tag) > MAX_TAG_LENGTH
    assert spec_error({"inline": {"tag": tag}}).startswith("capture.inline.tag:")


@pytest.mark.parametrize("tag", ["run1/part-2.x", "_x", "a.b", "A-1/b_2/c.3", "/".join(["a" * 100] * 2)])
def test_tag_accepted(tag):
    assert validate({"inline": {"tag": tag}})["inline"].tag == tag


# -- consumer options -----------------------------------------------------------------------------------


def test_options_are_normalised_by_the_consumer():
    spec = validate({"levels": {"level": "B", "positions": "all"}})["levels"]
    assert spec.options == {"level": "b"}
    assert spec.positions == "all"


def test_option_defaults_come_from_the_consumer():
    assert validate({"levels": {}})["levels"].options == {"level": "a"}


def test_bad_option_value_names_the_option():
    message = spec_error({"levels": {"level": "c"}})
    assert message.startswith("capture.levels.level: must be 'a' or 'b'")


def test_unknown_option_names_the_option():
    assert spec_error({"levels": {"colour": "red"}}).startswith("capture.levels.colour: unknown option")
    # The base class accepts no options at all.
    assert spec_error({"inline": {"level": "a"}}).startswith("capture.inline.level: unknown option")


def test_reserved_fields_are_not_options():
    spec = validate({"inline": {"hooks": "all", "positions": [0], "tag": "t"}})["inline"]
    assert spec.options == {}


# -- wire format ----------------------------------------------------------------------------------------


def test_wire_round_trip():
    spec = validate(
        {
            "inline": {"hooks": {"post_block": [3, 1], "pre_attn": "all"}, "positions": [0, 2], "tag": "run1/a"},
            "levels": {"level": "B", "positions": "all_generated"},
        }
    )
    # The wire crosses processes as JSON.
    wire = json.loads(json.dumps(spec_to_wire(spec)))
    assert wire["levels"]["level"] == "b"
    back = spec_from_wire(wire)
    assert back == spec
    assert back["levels"].options == {"level": "b"}
    assert back["inline"].site_names(NUM_LAYERS) == spec["inline"].site_names(NUM_LAYERS)
    # Validating the wire again changes nothing.
    assert validate(wire) == spec


def test_wire_round_trip_of_defaults():
    spec = validate({"inline": {}})
    assert spec_from_wire(spec_to_wire(spec)) == spec == {"inline": ConsumerSpec()}


def test_validated_spec_passes_through():
    spec = validate({"inline": {"positions": "all"}})
    assert validate(spec) == spec


def test_positions_beyond_any_sequence_are_refused_before_they_travel():
    # 2**31 and up would not survive msgpack on the way to the engine (and no sequence is that long).
    message = spec_error({"inline": {"positions": [3, 2**31]}})
    assert message.startswith("capture.inline.positions") and "[0, 2147483648)" in message
    assert validate({"inline": {"positions": [2**31 - 1]}})["inline"].positions == [2**31 - 1]


def test_consumer_options_with_integers_beyond_64_bits_are_refused_naming_them():
    class Anything(CaptureConsumer):  # a third-party consumer that takes any options
        name = "anything"

        @classmethod
        def validate_options(cls, options, engine):
            return options

    with pytest.raises(CaptureSpecError) as caught:
        validate_capture_spec({"anything": {"depth": {"levels": [1, 10**30]}}}, engine=EngineFacts(NUM_LAYERS),
                              consumers={"anything": Anything})
    assert str(caught.value) == "capture.anything.depth.levels.1: integer out of the 64-bit range"
