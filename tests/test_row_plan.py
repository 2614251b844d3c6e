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


def _masked(pick):
    """An answer that builds the slice's positions and masks them with ``pick(req, positions)``."""
    return lambda req, start, count: pick(req, np.arange(start, start + count))


def test_plan_maps_positions_to_rows_in_batch_order():
    wanted = {"a": {20, 31}, "b": {40}, "c": {0, 4}}
    plan = plan_reads(_layout(), {"a", "b", "c"}, _masked(lambda req, pos: np.isin(pos, list(wanted[req]))))
    assert plan.rows.tolist() == [4, 15, 16, 17, 21]
    assert [(r.req_id, r.slot_start, r.positions.tolist()) for r in plan.reads] == [
        ("a", 0, [20, 31]),
        ("b", 2, [40]),
        ("c", 3, [0, 4]),
    ]


def test_requests_without_reads_take_no_slots():
    plan = plan_reads(_layout(), {"a", "b", "c"}, _masked(lambda req, pos: np.ones(len(pos), bool) if req == "b"
                                                           else None if req == "a" else np.zeros(len(pos), bool)))
    assert plan.rows.tolist() == [16]
    assert plan.num_rows == 1
    only_b = plan_reads(_layout(), {"b"}, _masked(lambda req, pos: np.ones(len(pos), bool)))
    assert only_b.rows.tolist() == [16]  # requests outside ``only`` are not asked


def test_a_first_position_reads_the_rest_of_the_slice_like_the_mask_it_stands_for():
    for first in (0, 20, 31, 32, 41):
        by_first = plan_reads(_layout(), {"a", "b", "c"}, lambda req, start, count, f=first: f)
        masked = plan_reads(_layout(), {"a", "b", "c"}, _masked(lambda req, pos, f=first: pos >= f))
        assert by_first.rows.tolist() == masked.rows.tolist()
        assert [(r.req_id, r.slot_start, r.positions.tolist()) for r in by_first.reads] == [
            (r.req_id, r.slot_start, r.positions.tolist()) for r in masked.reads]
    assert plan_reads(_layout(), {"a"}, lambda *_: 20).rows.tolist() == list(range(4, 16))


def test_steering_rows_follow_each_tokens_phase():
    import torch

    from vllm_interp.models.registry import SiteBank
    from vllm_interp.steering.tables import FIRST_SLOT_ROW, GLOBAL_ROWS, SteeringTables
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
    index = tables.plan(_layout(), prompt_lens=[20, 10, 5], slots=[None, slot, None])
    assert index[:16].tolist() == [0] * 16 and index[17:].tolist() == [0] * 5
    assert index[16] == FIRST_SLOT_ROW + 1  # b's decode row
    tables.set_global(SteeringVectors({"prefill": {"0.pre_attn": np.ones(4, np.float32)}}))
    index = tables.plan(_layout(), prompt_lens=[20, 10, 5], slots=[None, slot, None])
    assert index[:4].tolist() == [GLOBAL_ROWS["prefill"]] * 4 and index[4:16].tolist() == [0] * 12
    assert index[17:].tolist() == [GLOBAL_ROWS["prefill"]] * 5
    assert torch.equal(bank.steer_table[0, 0, FIRST_SLOT_ROW], torch.ones(4))  # b's prefill row has the global
