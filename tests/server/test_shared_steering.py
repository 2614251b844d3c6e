"""The shared steering directory without a server: two API servers' views of one directory agree after a
change made through either, a server that starts later adopts what the first published, and changes from one
process apply one at a time."""

import asyncio

import numpy as np

from vllm_interp.hooks import ModelShape
from vllm_interp.server.shared_steering import SharedSteering
from vllm_interp.steering.state import SteeringState

SHAPE = ModelShape(4, 8)


def _vectors(value: float) -> dict:
    return {"post_block": {"1": [value] * SHAPE.hidden_size}}


def _view(directory) -> SharedSteering:
    return SharedSteering(directory, SteeringState(SHAPE, enabled=True))


def _described(shared: SharedSteering) -> tuple[dict, dict]:
    shared.refresh()
    state = shared.state
    return state.describe(), {name: vectors.digest() for name, vectors in state.named.items()}


def test_changes_through_one_server_reach_the_other(tmp_path):
    first = _view(tmp_path)
    first.state.register("early", {"vectors": _vectors(1.0)})  # as --steering-vectors files are, at start-up
    first.adopt_or_publish()
    second = _view(tmp_path)
    second.adopt_or_publish()  # starts later: takes what the first published, not its own empty state
    assert _described(second) == _described(first)

    async def set_global():
        first.state.commit(first.state.plan_set({"vectors": _vectors(2.0)}))

    async def register():
        second.state.register("late", {"vectors": _vectors(3.0)})

    asyncio.run(first.change(set_global))
    asyncio.run(second.change(register))  # made on the state the first one's change left
    assert sorted(second.state.named) == ["early", "late"]
    assert _described(first) == _described(second)
    assert np.array_equal(first.state.global_vectors.tiers["base"]["1.post_block"], np.full(8, 2.0, np.float32))


def test_changes_in_one_process_apply_one_at_a_time(tmp_path):
    shared = _view(tmp_path)
    shared.adopt_or_publish()
    order = []

    def registering(name: str):
        async def action():
            order.append(f"{name} start")
            await asyncio.sleep(0.01)  # an RPC to the workers would yield here
            shared.state.register(name, {"vectors": _vectors(1.0)})
            order.append(f"{name} end")
        return action

    async def both():
        await asyncio.gather(shared.change(registering("a")), shared.change(registering("b")))

    asyncio.run(both())
    assert order == ["a start", "a end", "b start", "b end"]
    assert sorted(_described(_view(tmp_path))[1]) == ["a", "b"]  # what a server looking now loads
