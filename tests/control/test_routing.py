"""Routing by predicted work, by room and by request count: pure decisions (no Ray, Redis or torch)."""

import pytest

from cluster.control.messages import RequestRecord
from cluster.control.placement import PendingRequest, WorkerBudget, first_fit_decreasing
from cluster.control.routing import (LeastWorkChooser, LiveWork, completion_cost, expected_tokens, least_requests_fit,
                                     least_work_fit, live_work, live_work_by_worker, route)


def test_a_request_goes_where_the_work_ahead_of_it_ends_soonest_not_where_there_are_fewer_requests():
    # w0: two requests with 500 tokens each still to come; w1: four that finish within 10 tokens.
    live = {"w0": LiveWork([500.0, 500.0]), "w1": LiveWork([10.0, 8.0, 5.0, 2.0])}
    free = {"w0": 100, "w1": 60}  # w0 even has more room
    assert least_work_fit(4, 200.0, free, live) == "w1"
    assert route("predicted_work", 4, 200.0, free, live) == "w1"
    assert route("least_requests", 4, 200.0, free, live) == "w0"
    assert route("room", 4, 200.0, free, live) == "w0"


def test_waiting_requests_go_where_they_finish_soonest_counting_those_placed_before_them_in_the_call():
    workers = [WorkerBudget("w0", 100, 0), WorkerBudget("w1", 100, 50)]  # w0 the roomiest
    chooser = LeastWorkChooser({"w0": LiveWork([400.0, 400.0]), "w1": LiveWork([20.0])})
    requests = [PendingRequest(f"r{i}", 1, float(i), work_tokens=100.0) for i in range(3)]
    placed = first_fit_decreasing(requests, workers, choose=chooser)
    # r0 and r1 join w1's short work (100+20, then 100+20+100); r2 costs 300 on w0, 320 on w1 by then.
    assert placed == {"r0": "w1", "r1": "w1", "r2": "w0"}
    # A request without a prediction to weigh takes the first that fits (the roomiest).
    assert LeastWorkChooser({})(PendingRequest("x", 1, 0.0), ["w0", "w1"]) == "w0"


def test_completion_cost_counts_each_request_ahead_only_while_it_shares_the_new_ones_steps():
    assert completion_cost(100.0, []) == 100.0
    assert completion_cost(100.0, [30.0, 500.0]) == 100.0 + 30.0 + 100.0
    # A very short request prefers the worker with many long ones over one with fewer but... still long ones:
    # only the first `own_tokens` steps of each matter to it.
    assert completion_cost(5.0, [500.0] * 2) < completion_cost(5.0, [500.0] * 3)


def test_only_workers_with_room_are_chosen_and_ties_go_to_the_roomiest_then_the_lowest_id():
    free = {"w0": 3, "w1": 50, "w2": 50}
    live = {"w0": LiveWork(), "w1": LiveWork([100.0]), "w2": LiveWork([100.0])}
    assert least_work_fit(4, 50.0, free, live) == "w1"  # w0 is idle but has no room
    assert least_work_fit(51, 50.0, free, live) is None
    assert least_requests_fit(4, {"w0": 10, "w1": 20}, {"w0": 1, "w1": 1}) == "w1"
    assert least_requests_fit(30, {"w0": 10, "w1": 20}, {}) is None


@pytest.mark.parametrize("own", [0.5, 3.0, 10.0, 45.0, 1e4])
def test_live_work_cost_is_completion_cost(own):
    remaining = [3.0, 10.0, 10.0, 44.0, 200.0]
    assert LiveWork(remaining).cost(own) == pytest.approx(completion_cost(own, remaining))


def test_requests_placed_but_not_yet_reported_count_with_their_whole_expected_length():
    work = live_work(("r1", "r2"), (40, 3), [("r1", 90.0), ("r3", 120.0)])
    # r1 is reported (its remaining counts, not its length); r3 is not yet (its whole length counts); r2 is no
    # longer placed there (it finished or moved since the stats were taken): it does not count
    assert len(work) == 2 and work.cost(1000.0) == completion_cost(1000.0, [40, 120.0])
    # stats without one value per request: the ledger's lengths
    assert live_work(("r1", "r2"), (), [("r1", 90.0)]).cost(1000.0) == completion_cost(1000.0, [90.0])


def _record(request_id: str, worker_id: str | None, predicted: int, max_tokens: int = 512) -> RequestRecord:
    return RequestRecord(request_id, worker_id, 10, max_tokens, predicted, 4, "placed", 1, 0.0)


def test_live_work_by_worker_reads_the_ledger_and_the_latest_stats():
    from workers.values.work_types import WorkerStats

    stats = WorkerStats("w0", 100, 50, 40, 50, 16, 1024, 1, 0, 10, 100, 0, 0, 0, 0, (), ("a",),
                        remaining_tokens=(25,))
    records = [_record("a", "w0", 100), _record("b", "w0", 60), _record("c", "w1", 30), _record("d", "w2", 5)]
    live = live_work_by_worker(["w0", "w1"], records, {"w0": stats})
    assert live["w0"].cost(1e6) == pytest.approx(1e6 + 25 + expected_tokens(records[1]))
    assert live["w1"].cost(1e6) == pytest.approx(1e6 + expected_tokens(records[2]))


def test_expected_tokens_grows_with_the_prediction_and_is_max_tokens_without_one():
    assert expected_tokens(_record("a", "w0", 0, max_tokens=300)) == 300.0
    assert expected_tokens(_record("a", "w0", 20)) < expected_tokens(_record("a", "w0", 200)) <= 512


def test_unknown_routing_is_refused():
    with pytest.raises(ValueError, match="routing must be one of predicted_work, room, least_requests"):
        route("random", 1, 1.0, {"w0": 1}, {})
