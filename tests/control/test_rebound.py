"""`cluster.control.rebound`: reservations re-planned by the bounds workers' probes refined (pure)."""

import time

from cluster.control.messages import RequestRecord
from cluster.control.rebound import rebounded_records
from workers.scheduling.policies import make_policy
from workers.values.work_types import BoundReport, WorkerStats


def _stats(worker_id: str, *reports: BoundReport) -> WorkerStats:
    return WorkerStats(worker_id, 100, 100, 0, 0, 16, 0, 0, 0, 0, 0, 0, 0, 0, 0, (), (), rebounded=reports)


def _record(request_id: str, worker_id: str | None = "w1", bound: int = 100, state: str = "placed") -> RequestRecord:
    return RequestRecord(request_id, worker_id, 20, 500, bound, 8, state, 1, time.time())


def test_only_this_workers_placed_requests_with_a_new_bound_are_re_planned_by_the_policy_rule():
    records = {r.request_id: r for r in [_record("same"), _record("lower"), _record("elsewhere", "w2"),
                                          _record("moving"), _record("pending", None, state="pending")]}
    stats = _stats("w1", BoundReport("same", 5, 100), BoundReport("lower", 64, 80),
                   BoundReport("elsewhere", 5, 10), BoundReport("moving", 5, 10), BoundReport("pending", 5, 10),
                   BoundReport("finished", 5, 10))
    s3 = make_policy("s3", max_model_len=1024)
    [lower] = list(rebounded_records(stats, records.get, s3.planned_tokens, 16, 1000, moving={"moving"}))
    assert (lower.request_id, lower.predicted_output_tokens) == ("lower", 80)
    assert lower.num_reserved_blocks == 7  # 20 + 80 tokens in blocks of 16
    assert lower.worker_id == "w1" and lower.num_attempts == 1  # nothing else changes


def test_the_re_planned_reservation_follows_the_policy_and_stays_within_the_cache():
    records = {"a": _record("a")}
    past_bound = _stats("w1", BoundReport("a", 90, 80))  # decoded past the new bound: s3 plans the next one
    s3 = make_policy("s3", max_model_len=1000)  # buckets of 100 tokens
    [a] = list(rebounded_records(past_bound, records.get, s3.planned_tokens, 16, 1000))
    assert a.num_reserved_blocks == -(-(20 + 160) // 16)  # next_bound: at least twice 80
    [clamped] = list(rebounded_records(_stats("w1", BoundReport("a", 5, 480)), records.get, s3.planned_tokens, 16, 10))
    assert clamped.num_reserved_blocks == 10
    paged = make_policy("paged_greedy")  # plans what is held: the bound does not change the reservation size
    [held] = list(rebounded_records(_stats("w1", BoundReport("a", 40, 300)), records.get, paged.planned_tokens, 16,
                                    1000))
    assert held.num_reserved_blocks == -(-(20 + 40) // 16)


def test_a_reservation_the_worker_holds_is_not_planned_away_and_a_router_without_prediction_is_re_planned():
    s3 = make_policy("s3", max_model_len=1024)
    records = {"held": _record("held"), "unknown": _record("unknown", bound=0)}  # 0: the router had no prediction
    stats = _stats("w1", BoundReport("held", 10, 30, num_reserved_tokens=128), BoundReport("unknown", 0, 60))
    held, unknown = rebounded_records(stats, records.get, s3.planned_tokens, 16, 1000)
    assert (held.predicted_output_tokens, held.num_reserved_blocks) == (30, 128 // 16)  # what the worker holds
    assert (unknown.predicted_output_tokens, unknown.num_reserved_blocks) == (60, -(-(20 + 60) // 16))


def test_each_record_is_looked_up_as_it_is_yielded_so_a_change_in_between_is_not_overwritten():
    s3 = make_policy("s3", max_model_len=1024)
    records = {"a": _record("a"), "b": _record("b")}
    stats = _stats("w1", BoundReport("a", 5, 50), BoundReport("b", 5, 50))
    updates = rebounded_records(stats, records.get, s3.planned_tokens, 16, 1000)
    assert next(updates).request_id == "a"
    del records["b"]  # finished while "a" was being written
    assert list(updates) == []
