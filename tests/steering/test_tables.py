"""The worker's steering tables, without an engine: each config slot's prefill and decode rows hold exactly the
global vectors plus the request's for that phase, in the table's dtype, at the layers this stage holds, and a
reused slot keeps nothing of its last owner."""

import numpy as np
import torch

from vllm_interp.hooks import HOOK_INDEX, parse_site_name
from vllm_interp.models.registry import SiteBank
from vllm_interp.request_args import EXTRA_ARGS_KEY
from vllm_interp.row_plan import BatchLayout
from vllm_interp.steering.tables import GLOBAL_ROWS, SteeringTables, table_rows
from vllm_interp.steering.vectors import SteeringVectors

HIDDEN = 8
HELD = {0: 0, 2: 1}  # layer -> its slot in the tables (layer 1 is another pipeline stage's)


def _tables(max_configs: int = 1) -> SteeringTables:
    bank = SiteBank(layers=sorted(HELD), steer_index=torch.zeros(4, dtype=torch.long),
                    steer_table=torch.zeros(len(HELD), 3, table_rows(max_configs), HIDDEN, dtype=torch.bfloat16),
                    patch_index=torch.zeros(len(HELD), 3, 1, dtype=torch.long), patch_values=torch.zeros(1, HIDDEN),
                    patch_alpha=torch.zeros(1), read_slot=torch.full((1,), -1), read_flags=torch.zeros(len(HELD), 3),
                    read_out=torch.zeros(len(HELD), 3, 0, HIDDEN))
    return SteeringTables(bank, max_configs)  # one slot by default: the second request reuses the first one's


def _vectors(seed: int, **tiers: list[str]) -> SteeringVectors:
    rng = np.random.default_rng(seed)
    return SteeringVectors({tier: {name: rng.standard_normal(HIDDEN).astype(np.float32) for name in names}
                            for tier, names in tiers.items()})


def _expected_row(vectors: SteeringVectors, phase: str) -> torch.Tensor:
    row = np.zeros((len(HELD), 3, HIDDEN), np.float32)
    for name, vector in vectors.phase_vectors(phase).items():
        layer, hook = parse_site_name(name)
        if layer in HELD:
            row[HELD[layer], HOOK_INDEX[hook]] = vector
    return torch.from_numpy(row).to(torch.bfloat16)


def _request(vectors: SteeringVectors, digest: str) -> dict:
    return {EXTRA_ARGS_KEY: {"steering": {"vectors": vectors.to_wire(), "digest": digest}}}


def test_slot_rows_hold_global_plus_request_vectors_per_phase_and_nothing_of_a_last_owner():
    tables = _tables()
    table = tables.bank.steer_table
    global_vectors = _vectors(0, base=["0.pre_attn"], decode=["2.post_block"])
    tables.set_global(global_vectors)
    for phase, row in GLOBAL_ROWS.items():
        assert torch.equal(table[:, :, row], _expected_row(global_vectors, phase)), phase
    first = _vectors(1, base=["2.post_attn", "1.post_block", "0.pre_attn"], prefill=["0.post_block"])
    slot = tables.lookup("a", _request(first, "first"))
    tables.upload_pending()  # as the step's index load does
    for phase in ("prefill", "decode"):
        assert torch.equal(table[:, :, slot.row(phase)], _expected_row(global_vectors + first, phase)), phase
    # The slot freed, then taken by vectors at other sites (base only: both phases alike).
    tables.forget_finished(set())
    second = _vectors(2, base=["2.pre_attn"])
    reused = tables.lookup("b", _request(second, "second"))
    tables.upload_pending()
    assert reused.index == slot.index
    for phase in ("prefill", "decode"):
        assert torch.equal(table[:, :, reused.row(phase)], _expected_row(global_vectors + second, phase)), phase


def test_configs_queued_together_are_written_in_one_upload_each_to_its_own_rows():
    tables = _tables(max_configs=4)
    table = tables.bank.steer_table
    configs = {
        "base": _vectors(3, base=["0.pre_attn", "2.post_block"]),
        "split": _vectors(4, base=["2.post_attn"], prefill=["0.post_block"], decode=["2.post_attn", "1.pre_attn"]),
        "same sites": _vectors(5, base=["0.pre_attn", "2.post_block"]),  # the first config's names, other values
        "other stage": _vectors(6, base=["1.post_block"]),  # nothing this stage holds
    }
    slots = {digest: tables.lookup(digest, _request(vectors, digest)) for digest, vectors in configs.items()}
    tables.upload_pending()
    for digest, vectors in configs.items():
        for phase in ("prefill", "decode"):
            assert torch.equal(table[:, :, slots[digest].row(phase)], _expected_row(vectors, phase)), (digest, phase)


def test_a_step_looks_up_only_its_new_requests_and_frees_the_slots_of_those_that_left_before_taking_new_ones():
    tables = _tables()  # one slot
    asked: list[str] = []
    requests = {"plain-1": None, "plain-2": None, "steered": _request(_vectors(1, decode=["0.post_block"]), "d1"),
                "next": _request(_vectors(2, base=["2.pre_attn"]), "d2")}

    def request(req_id: str):
        asked.append(req_id)
        return requests[req_id], 3

    def step(*req_ids: str):  # one decode token each, past the prompt of 3
        return tables.step_index(BatchLayout.of(list(req_ids), np.arange(len(req_ids) + 1), np.full(len(req_ids), 5)),
                                 request)

    assert step("plain-1", "plain-2") is None and step("plain-1", "plain-2") is None
    assert asked == ["plain-1", "plain-2"]  # an idle batch: each request looked up once, when new
    index = step("plain-1", "steered")
    assert index.tolist() == [0, tables._by_req["steered"].row("decode")]
    # "steered" leaves as "next" arrives: its slot is freed first, for the new config.
    assert step("plain-1", "next").tolist() == [0, tables._by_req["next"].row("decode")]
    assert step("plain-1") is None  # no steered request left: no index


def test_the_index_buffer_holds_each_steps_map_and_an_unchanged_map_is_not_uploaded_again():
    tables = _tables()
    target = tables.bank.steer_index
    tables.load_index(np.array([3, 4, 3]))
    assert target.tolist() == [3, 4, 3, 0]
    target[0] = 9  # behind the tables' back: a steady batch's next decode step uploads nothing
    tables.load_index(np.array([3, 4, 3]))
    assert target.tolist() == [9, 4, 3, 0]
    tables.load_index(np.array([4, 4]))  # a shorter map: the rows the last one used go back to row 0
    assert target.tolist() == [4, 4, 0, 0]
    tables.load_index(None)
    assert target.tolist() == [0, 0, 0, 0]
    tables.load_index(np.array([4, 4]))  # the map before None: uploaded again
    assert target.tolist() == [4, 4, 0, 0]


def test_steered_sites_are_the_global_vectors_and_those_of_configs_holding_a_slot():
    tables = _tables()
    assert tables.steered_sites == frozenset()
    tables.set_global(_vectors(0, base=["0.pre_attn"]))
    assert tables.steered_sites == {(0, HOOK_INDEX["pre_attn"])}
    tables.lookup("a", _request(_vectors(1, decode=["2.post_block"], prefill=["1.post_attn"]), "a"))
    assert tables.steered_sites == {(0, HOOK_INDEX["pre_attn"]), (2, HOOK_INDEX["post_block"]),
                                    (1, HOOK_INDEX["post_attn"])}
    tables.forget_finished(set())  # "a" left: its slot and its sites go
    assert tables.steered_sites == {(0, HOOK_INDEX["pre_attn"])}


def test_a_steady_batch_takes_its_last_index_until_a_token_would_change_rows():
    """The same batch's next decode step takes the last step's index as it is, without asking anything; a step
    with a token still in its prompt, a changed batch or a global change plans afresh."""
    tables = _tables(max_configs=2)
    asked: list[str] = []
    requests = {"a": _request(_vectors(1, prefill=["0.pre_attn"], decode=["2.post_block"]), "a"), "b": None}

    def request(req_id: str):
        asked.append(req_id)
        return requests[req_id], 4  # prompts of 4 tokens

    def step(positions: list[int], req_ids: tuple[str, ...] = ("a", "b")):  # one token each at these positions
        layout = BatchLayout.of(list(req_ids), np.arange(len(req_ids) + 1), np.array(positions))
        return tables.step_index(layout, request)

    prefill, decode = tables.lookup("a", requests["a"]).row("prefill"), tables._slots["a"].row("decode")
    asked.clear()
    last_prompt = step([3, 9])  # "a" computes its last prompt token in a one-token step
    assert last_prompt.tolist() == [prefill, 0]
    first_decode = step([4, 10])  # not the last index: "a" moved from its prefill row to its decode row
    assert first_decode.tolist() == [decode, 0]
    assert step([5, 11]) is first_decode and step([6, 12]) is first_decode  # steady: nothing planned again
    # The same batch with two tokens for "a" (a draft token to verify): its rows planned for this step.
    layout = BatchLayout.of(["a", "b"], np.array([0, 2, 3]), np.array([7, 13]))
    assert tables.step_index(layout, request).tolist() == [decode, decode, 0]
    assert step([7, 13], ("b", "a")).tolist() == [0, decode]  # another order: planned again
    tables.set_global(_vectors(2, base=["0.post_attn"]))
    rows = step([8, 14], ("b", "a"))
    assert rows.tolist() == [GLOBAL_ROWS["decode"], decode]  # the global vectors reach the unsteered request
    assert asked == ["a", "b"]  # each request looked up once, when it first came


def test_an_unsteered_batch_stays_unsteered_until_a_global_vector_is_set():
    tables = _tables()
    layout = BatchLayout.of(["p"], np.array([0, 3]), np.array([0]))  # a prefill chunk of 3 tokens
    request = lambda req_id: (None, 8)  # noqa: E731
    assert tables.step_index(layout, request) is None
    assert tables.step_index(layout, request) is None  # steady: no token steered, whatever it schedules
    tables.load_index(None)
    # Any step of the batch repeats the index (a prefill chunk too), one of another batch does not.
    assert tables.repeats(["p"], 3) and tables.repeats(["p"], 1) and not tables.repeats(["p", "q"], 2)
    assert not tables.steers
    tables.set_global(_vectors(0, prefill=["2.pre_attn"]))
    assert not tables.repeats(["p"], 3)
    assert tables.step_index(layout, request).tolist() == [GLOBAL_ROWS["prefill"]] * 3
