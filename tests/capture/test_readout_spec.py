import numpy as np
import pytest

from vllm_interp.capture.readout import ReadoutSpecError, validate_readout_spec


def test_defaults_read_every_site_at_the_last_prompt_token():
    spec = validate_readout_spec({}, num_layers=2)
    assert spec.site_names(2) == [
        "0.pre_attn", "0.post_attn", "0.post_block", "1.pre_attn", "1.post_attn", "1.post_block",
    ]
    assert spec.select(np.arange(6), prompt_len=4).tolist() == [False, False, False, True, False, False]


@pytest.mark.parametrize(
    ("positions", "expected"),
    [
        ("all", [0, 1, 2, 3, 4, 5]),
        ("all_prompt", [0, 1, 2, 3]),
        ("last_prompt", [3]),
        ("all_generated", [4, 5]),
        ([1, 5], [1, 5]),
    ],
)
def test_position_selectors(positions, expected):
    spec = validate_readout_spec({"positions": positions}, num_layers=2)
    assert spec.expected_positions(prompt_len=4, num_computed=6) == expected


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"layers": [0, 7]}, "readout.layers"),
        ({"layers": []}, "readout.layers"),
        ({"hooks": ["mlp_out"]}, "readout.hooks"),
        ({"positions": [-1]}, "readout.positions"),
        ({"positions": "first"}, "readout.positions"),
        ({"positions": [2, 2]}, "readout.positions"),
        ({"where": "all"}, "readout.where"),
    ],
)
def test_bad_specs_name_the_field(raw, field):
    with pytest.raises(ReadoutSpecError, match=field):
        validate_readout_spec(raw, num_layers=4)
