"""The patch spec's one validation, without an engine."""

import pytest

from vllm_interp.hooks import ModelShape
from vllm_interp.patching.spec import PatchError, validate_patch

SHAPE = ModelShape(num_layers=4, hidden_size=8)


def _validate(raw):
    return validate_patch(raw, shape=SHAPE, enabled=True, max_patches=16,
                          run_generation=lambda run: "g1" if run == "clean" else None)


@pytest.mark.parametrize(("entry", "field"), [
    ({"layer": 1, "hook": "post_block", "position": 2**31, "source": {"zeros": True}}, "patch.0.position"),
    ({"layer": 1, "hook": "post_block", "position": 0, "source": {"run": "clean", "position": 10**30}},
     "patch.0.source.position"),
])
def test_positions_beyond_any_sequence_are_refused_naming_the_field(entry, field):
    # A 31-digit position once reached the engine's transport and failed there with a 500.
    with pytest.raises(PatchError) as caught:
        _validate([entry])
    assert str(caught.value).startswith(f"{field}: ") and "out of range [0, 2147483648)" in str(caught.value)


def test_the_largest_position_is_accepted():
    spec = _validate([{"layer": 1, "hook": "post_block", "position": 2**31 - 1,
                       "source": {"run": "clean", "position": 2**31 - 1}}])
    assert spec.entries[0].position == spec.entries[0].run_position == 2**31 - 1
