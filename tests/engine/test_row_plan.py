import numpy as np

from vllm_interp.engine.row_plan import batch_slices, plan_reads


def _slices():
    # Three requests in one step: a prompt chunk (positions 16..31), a decode token (position 40) and a
    # fresh prompt (positions 0..4), flattened as rows 0..15, 16, 17..21.
    return batch_slices(["a", "b", "c"], np.array([0, 16, 17, 22]), np.array([16, 40, 0]))


def test_batch_slices_follow_the_flattened_layout():
    a, b, c = _slices()
    assert (a.row_start, a.position_start, a.num_tokens) == (0, 16, 16)
    assert (b.row_start, b.position_start, b.num_tokens) == (16, 40, 1)
    assert (c.row_start, c.position_start, c.num_tokens) == (17, 0, 5)


def test_plan_maps_positions_to_rows_in_batch_order():
    wanted = {"a": {20, 31}, "b": {40}, "c": {0, 4}}
    plan = plan_reads(_slices(), lambda req, pos: np.isin(pos, list(wanted[req])), capacity=8)
    assert plan.rows.tolist() == [4, 15, 16, 17, 21]
    assert [(r.req_id, r.slot_start, r.positions.tolist()) for r in plan.reads] == [
        ("a", 0, [20, 31]),
        ("b", 2, [40]),
        ("c", 3, [0, 4]),
    ]
    assert plan.overflow == {}


def test_requests_without_reads_take_no_slots():
    plan = plan_reads(_slices(), lambda req, pos: None if req != "b" else np.ones(len(pos), bool), capacity=8)
    assert plan.rows.tolist() == [16]
    assert plan.num_rows == 1


def test_overflow_is_counted_not_dropped_silently():
    plan = plan_reads(_slices(), lambda req, pos: np.ones(len(pos), bool), capacity=10)
    assert plan.num_rows == 10
    assert plan.overflow == {"a": 6, "b": 1, "c": 5}
