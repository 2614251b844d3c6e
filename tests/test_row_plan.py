"""The row planner: which flat rows of a step each request's planned positions land on."""

import numpy as np

from vllm_interp.row_plan import BatchLayout, plan_reads


def _layout():
    # Three requests in one step: a prompt chunk (positions 16..31), a decode token (position 40) and a
    # fresh prompt (positions 0..4), flattened as rows 0..15, 16, 17..21.
    return BatchLayout.of(["a", "b", "c"], np.array([0, 16, 17, 22]), np.array([16, 40, 0]))


def _slices():
    return _layout().slices()


def test_batch_slices_follow_the_flattened_layout():
    a, b, c = _slices()
    assert (a.row_start, a.position_start, a.num_tokens) == (0, 16, 16)
    assert (b.row_start, b.position_start, b.num_tokens) == (16, 40, 1)
    assert (c.row_start, c.position_start, c.num_tokens) == (17, 0, 5)
    assert [s.req_id for s in _layout().slices(only={"c", "a"})] == ["a", "c"]  # batch order, only those


def _plan(only, answer):
    """The plan of ``_layout()`` where each request in ``only`` answers ``answer(req_id, position_start,
    num_tokens)``."""
    layout = _layout()
    return plan_reads(layout, {i: answer(req_id, int(layout.position_starts[i]), int(layout.num_tokens[i]))
                               for i, req_id in enumerate(layout.req_ids) if req_id in only})


def _reads(plan):
    return [(req_id, int(plan.slot_starts[k]), plan.positions_of(k).tolist()) for k, req_id in enumerate(plan.req_ids)]


def _masked(pick):
    """An answer that builds the slice's positions and masks them with ``pick(req, positions)``."""
    return lambda req, start, count: pick(req, np.arange(start, start + count))


def test_plan_maps_positions_to_rows_in_batch_order():
    wanted = {"a": {20, 31}, "b": {40}, "c": {0, 4}}
    plan = _plan({"a", "b", "c"}, _masked(lambda req, pos: np.isin(pos, list(wanted[req]))))
    assert plan.rows.tolist() == [4, 15, 16, 17, 21]
    assert plan.splits() == [(0, 2), (2, 3), (3, 5)]
    assert _reads(plan) == [
        ("a", 0, [20, 31]),
        ("b", 2, [40]),
        ("c", 3, [0, 4]),
    ]


def test_requests_without_reads_take_no_slots():
    plan = _plan({"a", "b", "c"}, lambda req, start, count: np.ones(count, bool) if req == "b"
                 else None if req == "a" else np.zeros(count, bool))
    assert plan.rows.tolist() == [16]
    assert plan.num_rows == 1 and plan.req_ids == ["b"]
    only_b = _plan({"b"}, lambda req, start, count: 0)
    assert only_b.rows.tolist() == [16]  # requests without an answer read nothing
    assert _plan(set(), lambda *_: 0).num_rows == 0


def test_a_first_position_reads_the_rest_of_the_slice_like_the_mask_it_stands_for():
    for first in (0, 20, 31, 32, 41):
        by_first = _plan({"a", "b", "c"}, lambda req, start, count, f=first: f)
        masked = _plan({"a", "b", "c"}, _masked(lambda req, pos, f=first: pos >= f))
        assert by_first.rows.tolist() == masked.rows.tolist()
        assert _reads(by_first) == _reads(masked)
    assert _plan({"a"}, lambda *_: 20).rows.tolist() == list(range(4, 16))


def test_mixed_answers_and_rows_that_do_not_start_at_zero():
    """Rows follow each request's row start (vLLM may lay a batch out from an offset); a first position and
    masks mix in one step."""
    layout = BatchLayout.of(["a", "b", "c"], np.array([3, 19, 20, 25]), np.array([16, 40, 0]))
    plan = plan_reads(layout, {0: 30, 1: None, 2: np.array([True, False, False, False, True])})
    assert plan.rows.tolist() == [17, 18, 20, 24]
    assert plan.positions.tolist() == [30, 31, 0, 4]
    assert plan.req_ids == ["a", "c"] and plan.splits() == [(0, 2), (2, 4)]


def test_steering_rows_follow_each_tokens_phase():
    import torch

    from vllm_interp.models.registry import SiteBank
    from vllm_interp.steering.tables import FIRST_SLOT_ROW, GLOBAL_ROWS, NO_SLOT, SteeringTables
    from vllm_interp.steering.vectors import SteeringVectors

    bank = SiteBank(layers=[0], steer_index=torch.zeros(32, dtype=torch.long), steer_table=torch.zeros(1, 3, 7, 4),
                    patch_index=torch.zeros(1, 3, 1, dtype=torch.long), patch_values=torch.zeros(1, 4),
                    patch_alpha=torch.zeros(1), read_slot=torch.full((1,), -1), read_flags=torch.zeros(1, 3),
                    read_out=torch.zeros(1, 3, 0, 4))
    tables = SteeringTables(bank, max_configs=2)
    vectors = SteeringVectors({"decode": {"0.post_block": np.ones(4, np.float32)}})
    slot = tables.lookup("b", {"vllm_interp": {"steering": {"vectors": vectors.to_wire(), "digest": "d"}}})
    # "a" (prompt of 20) has positions 16..31: the tier is decided per position, so its first four tokens
    # are prefill and the rest decode; "b" is one decode token; "c" a fresh prompt. No global vectors yet:
    # only "b" is steered.
    index = tables.plan(_layout(), prefill_rows=np.array([NO_SLOT, slot.row("prefill"), NO_SLOT]),
                        prompt_lens=np.array([20, 10, 5]))
    assert index[:16].tolist() == [0] * 16 and index[17:].tolist() == [0] * 5
    assert index[16] == FIRST_SLOT_ROW + 1  # b's decode row
    tables.set_global(SteeringVectors({"prefill": {"0.pre_attn": np.ones(4, np.float32)}}))
    index = tables.plan(_layout(), prefill_rows=np.array([NO_SLOT, slot.row("prefill"), NO_SLOT]),
                        prompt_lens=np.array([20, 10, 5]))
    assert index[:4].tolist() == [GLOBAL_ROWS["prefill"]] * 4 and index[4:16].tolist() == [0] * 12
    assert index[17:].tolist() == [GLOBAL_ROWS["prefill"]] * 5
    assert torch.equal(bank.steer_table[0, 0, FIRST_SLOT_ROW], torch.ones(4))  # b's prefill row has the global
