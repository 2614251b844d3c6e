"""The scheduler mixins' own logic, around stand-ins for the scheduler's pass and on vLLM's own request queues:
waiting requests whose config is new wait while every slot is held, in order, and a pass with nothing steered
waiting reads nothing of the running requests (tests/steering/test_steering.py runs the gate in a real engine:
nine configs through four slots); a finished request's final length rides beside its id
(tests/capture/test_capture_engine.py sees it reach a real engine's worker)."""

from types import SimpleNamespace

from vllm.v1.core.sched.request_queue import FCFSRequestQueue

from vllm_interp.engine.v0_26.scheduler_gate import FinalLengths, SteeringAdmission, final_lengths
from vllm_interp.request_args import EXTRA_ARGS_KEY


class _Request:
    """A request as the gate reads it (its sampling params' extra args), counting how often it is read."""

    def __init__(self, name: str, digest: str | None) -> None:
        self.name, self.reads = name, 0
        self.extra_args = {EXTRA_ARGS_KEY: {"steering": {"digest": digest}} if digest else {}}

    @property
    def sampling_params(self) -> SimpleNamespace:
        self.reads += 1
        return SimpleNamespace(extra_args=self.extra_args)


class _Parent:
    def __init__(self) -> None:
        self.scheduled: list[list[str]] = []

    def schedule(self) -> None:
        self.scheduled.append([request.name for request in self.waiting])


class _Gated(SteeringAdmission, _Parent):
    def __init__(self, running: list[_Request], waiting: list[_Request], limit: int) -> None:
        _Parent.__init__(self)
        self.running, self.skipped_waiting, self.waiting = running, FCFSRequestQueue(), FCFSRequestQueue()
        for request in waiting:
            self.waiting.add_request(request)
        self._interp_slot_limit = limit


def test_requests_with_new_configs_wait_for_a_slot_in_order_and_come_back_after_the_pass():
    running = [_Request("r1", "a"), _Request("r2", "b")]
    waiting = [_Request("w1", "b"), _Request("w2", "c"), _Request("w3", None), _Request("w4", "d")]
    gated = _Gated(running, waiting, limit=3)
    gated.schedule()
    # "b" is held by a running request, "c" takes the last slot, "d" waits; the unsteered one is never held.
    assert gated.scheduled == [["w1", "w2", "w3"]]
    assert [request.name for request in gated.waiting] == ["w4", "w1", "w2", "w3"]


def test_a_pass_with_nothing_steered_waiting_reads_no_running_request():
    running = [_Request(f"r{i}", f"d{i}") for i in range(4)]
    gated = _Gated(running, [_Request("plain", None)], limit=4)
    gated.schedule()
    gated.schedule()
    assert [request.reads for request in running] == [0, 0, 0, 0]
    assert gated.scheduled == [["plain"], ["plain"]]


class _Freeing:
    """The scheduler's side of a finish: a freed request's id joins the next pass's output."""

    def __init__(self) -> None:
        self.finished_req_ids: set[str] = set()

    def _free_request(self, request: SimpleNamespace) -> None:
        self.finished_req_ids.add(request.request_id)

    def schedule(self) -> SimpleNamespace:
        output, self.finished_req_ids = SimpleNamespace(finished_req_ids=self.finished_req_ids), set()
        return output


class _WithLengths(FinalLengths, _Freeing):
    pass


def test_a_finished_requests_final_length_rides_beside_its_id_once():
    scheduler = _WithLengths()
    assert final_lengths(scheduler.schedule()) == {}  # nothing freed yet
    scheduler._free_request(SimpleNamespace(request_id="a", num_tokens=9))
    scheduler._free_request(SimpleNamespace(request_id="b", num_tokens=4))
    assert final_lengths(scheduler.schedule()) == {"a": 9, "b": 4}
    assert final_lengths(scheduler.schedule()) == {} and scheduler._interp_freed == {}
    assert final_lengths(SimpleNamespace(finished_req_ids=set())) == {}  # an output the scheduler did not make
