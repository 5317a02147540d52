"""`bench chaos` accounting without a service: each request's fate, per-fault windows, totals."""

import pytest

from benchmarks.chaos_accounting import FaultEvent, fate, fault_rows, totals
from benchmarks.chaos_bench import ChaosBenchConfig, load_plan
from benchmarks.http_load import CANCELLED, RequestResult

MAX_TOKENS = 8


def result(sent_s: float = 0.0, status: int | None = 200, tokens: int | None = MAX_TOKENS, events: int = 5,
           done: bool = True, error: str | None = None, retry_after_s: float | None = None, digest: str = "right",
           request_id: str = "r") -> RequestResult:
    return RequestResult(request_id, error is None and status == 200, status, error, sent_s, None, sent_s + 1.0,
                         tokens, 4, None, retry_after_s, events, done, digest)


@pytest.mark.parametrize("kwargs, expected", [
    ({}, "whole"),
    ({"tokens": MAX_TOKENS + 1}, "duplicated"),
    ({"events": MAX_TOKENS + 1}, "duplicated"),  # more text events than tokens: something was sent twice
    ({"tokens": MAX_TOKENS - 1}, "truncated"),
    ({"done": False}, "truncated"),
    ({"error": '{"message": "generation failed"}'}, "truncated"),
    ({"tokens": None, "done": False}, "truncated"),
    ({"status": 429, "tokens": None, "retry_after_s": 1.0}, "refused"),
    ({"status": 503, "tokens": None, "retry_after_s": 2.0}, "refused"),
    ({"status": 503, "tokens": None}, "failed"),  # a 503 that does not say when to retry loses the request
    ({"status": 500, "tokens": None}, "failed"),
    ({"status": None, "tokens": None, "error": "ConnectError"}, "failed"),
    ({"tokens": None, "done": False, "error": CANCELLED}, "cancelled"),  # the plan's hang-up: not lost
])
def test_each_request_meets_exactly_one_fate(kwargs, expected):
    assert fate(result(**kwargs), MAX_TOKENS) == expected


@pytest.mark.parametrize("kwargs, reference, expected", [
    ({}, "right", "whole"),
    ({"digest": "wrong"}, "right", "corrupted"),  # every token arrived, once, but not the fault-free text
    ({"digest": "wrong"}, None, "whole"),  # no reference: the text is not checked
    ({"digest": "wrong", "tokens": MAX_TOKENS - 1}, "right", "truncated"),
    ({"digest": "wrong", "tokens": MAX_TOKENS + 1}, "right", "duplicated"),
])
def test_a_whole_answer_must_also_be_the_fault_free_text(kwargs, reference, expected):
    assert fate(result(**kwargs), MAX_TOKENS, reference) == expected


def test_requests_are_counted_in_the_window_of_the_fault_in_force_when_sent():
    start_unix_s = 1000.0
    events = [FaultEvent("none", 1005.0, 0.0, 100.0, 101.0), FaultEvent("kill_redis", 1015.0, 0.5, 101.0, 103.0),
              FaultEvent("burst", 1025.0, 2.0, 103.0, 104.0)]
    results = [result(sent_s=1.0),  # warm-up: before the first window, not counted
               result(sent_s=6.0), result(sent_s=14.9),
               result(sent_s=15.0, tokens=3), result(sent_s=16.0, status=503, tokens=None, retry_after_s=2.0),
               result(sent_s=26.0, status=429, tokens=None, retry_after_s=1.0), result(sent_s=99.0)]
    rows = fault_rows(results, start_unix_s, list(reversed(events)), MAX_TOKENS)
    assert [r["name"] for r in rows] == ["none", "kill_redis", "burst"]
    none, redis, burst = rows
    assert (none["sent"], none["completed"], none["lost"]) == (2, 2, 0)
    assert (redis["sent"], redis["truncated"], redis["refused"], redis["lost"]) == (2, 1, 1, 1)
    assert redis["failed_by_status"] == {"503": 1} and redis["recovery_s"] == 0.5
    assert (burst["sent"], burst["completed"], burst["refused"]) == (2, 1, 1)
    summary = totals(rows, memory_start_mib=100.0, memory_end_mib=104.0)
    assert summary["sent"] == 6 and summary["lost"] == 1 and summary["max_recovery_s"] == 2.0
    assert summary["memory_growth"] == pytest.approx(0.04)


def test_corrupted_answers_are_lost_in_their_window_and_the_totals():
    events = [FaultEvent("none", 0.0, 0.0, 1.0, 1.0), FaultEvent("kill_worker", 10.0, 1.0, 1.0, 1.0)]
    results = [result(sent_s=1.0, request_id="a"), result(sent_s=11.0, request_id="b", digest="resumed wrong"),
               result(sent_s=12.0, request_id="c")]
    rows = fault_rows(results, 0.0, events, MAX_TOKENS, references={"a": "right", "b": "right", "c": "right"})
    assert [(r["completed"], r["corrupted"], r["lost"]) for r in rows] == [(1, 0, 0), (1, 1, 1)]
    assert rows[1]["lost_examples"] == [{"request_id": "b", "fate": "corrupted", "status": 200, "tokens": MAX_TOKENS,
                                         "error": None}]
    summary = totals(rows, 1.0, 1.0)
    assert (summary["corrupted"], summary["lost"]) == (1, 1)


def test_a_fault_that_never_recovered_makes_the_run_never_recover():
    rows = fault_rows([], 0.0, [FaultEvent("none", 0.0, 0.0, 1.0, 1.0), FaultEvent("kill_worker", 5.0, None, 1, 1)],
                      MAX_TOKENS)
    assert totals(rows, 1.0, 1.0)["max_recovery_s"] is None


def test_the_load_runs_at_a_fixed_rate_to_the_end_of_the_last_window():
    config = ChaosBenchConfig(rate_per_s=2.0, window_s=10.0, warmup_s=5.0, faults=("kill_redis", "burst"))
    plan = load_plan(config, "http://127.0.0.1:1", "m")
    assert plan.endpoint == "chat" and len(plan.requests) == 2 * (5 + 10 * 3)
    assert [r.arrival_s for r in plan.requests[:3]] == [0.0, 0.5, 1.0]
    assert all(r.max_tokens == r.forced_output_tokens == config.max_tokens for r in plan.requests)


def test_bad_configs_are_refused():
    with pytest.raises(ValueError, match="unknown faults"):
        ChaosBenchConfig(faults=("kill_everything",))
    with pytest.raises(ValueError, match="num_workers >= 2"):
        ChaosBenchConfig(num_workers=1)
    with pytest.raises(ValueError, match="positive"):
        ChaosBenchConfig(rate_per_s=0)
