"""`bench soak` without a service: when faults land, the load's mix, the per-minute rows and the growth."""

import pytest

from benchmarks.http_load import CANCELLED, RequestResult
from benchmarks.soak_bench import SoakBenchConfig, fault_times_s, growth, load_plan, minute_rows, quick_config


def test_faults_land_between_the_second_minute_and_the_last():
    config = quick_config()
    times = fault_times_s(config)
    assert len(times) == len(config.faults) == 3
    assert all(120.0 < t < (config.minutes - 2) * 60.0 for t in times) and times == sorted(times)


def test_the_load_mixes_streamed_whole_and_hung_up_chats_at_the_rate():
    plan = load_plan(quick_config(), "http://127.0.0.1:1", "m", rate_per_s=2.0)
    assert len(plan.requests) == 600 and plan.endpoint == "chat"
    first = plan.requests[:10]
    assert [r.arrival_s for r in first[:3]] == [0.0, 0.5, 1.0]
    assert sum(r.stream for r in first) == 7 and sum(r.cancel_after_events is not None for r in first) == 1
    assert all(r.max_tokens == r.forced_output_tokens == 32 for r in plan.requests)


def _result(request_id: str, sent_s: float, latency_s: float, digest: str = "ok", tokens: int = 32,
            error: str | None = None) -> RequestResult:
    return RequestResult(request_id, error is None, 200, error, sent_s, sent_s + 0.1, sent_s + latency_s,
                         tokens if error is None else None, 4, None, None, 3, error is None, digest)


def test_minutes_count_fates_latency_and_the_last_sample_in_each():
    results = [_result("a", 10.0, 1.0), _result("b", 20.0, 3.0), _result("c", 30.0, 2.0, error=CANCELLED),
               _result("d", 70.0, 2.0, digest="other"), _result("e", 80.0, 2.0, tokens=5)]
    samples = [{"unix_s": 1000.0 + t, "rss_mib": m, "open_fds": f, "redis_keys": k}
               for t, m, f, k in ((5.0, 100.0, 50, 7), (50.0, 110.0, 52, 8), (65.0, 120.0, 52, 9))]
    rows = minute_rows(results, 1000.0, samples, dict.fromkeys("abcde", "ok"), 32, minutes=2)
    first, second = rows
    assert (first["sent"], first["whole"], first["cancelled"], first["lost"]) == (3, 2, 1, 0)
    assert first["latency_p50_s"] == pytest.approx(2.0) and first["rss_mib"] == 110.0 and first["open_fds"] == 52
    assert (second["whole"], second["corrupted"], second["lost"]) == (0, 1, 2)  # another text; a truncated one
    assert second["latency_p99_s"] is None and second["redis_keys"] == 9


def test_growth_runs_from_the_second_minute_to_the_last():
    rows = [{"rss_mib": 50.0, "latency_p99_s": 9.0, "open_fds": 10, "redis_keys": 1, "redis_keys_without_ttl": 1},
            {"rss_mib": 100.0, "latency_p99_s": 2.0, "open_fds": 40, "redis_keys": 5, "redis_keys_without_ttl": 3},
            {"rss_mib": 103.0, "latency_p99_s": 2.2, "open_fds": 40, "redis_keys": 9, "redis_keys_without_ttl": 3}]
    out = growth(rows)
    assert out["rss_growth"] == pytest.approx(0.03) and out["p99_drift"] == pytest.approx(0.10)
    assert out["fds_growth"] == 0 and out["redis_keys_growth"] == 4 and out["redis_keys_without_ttl_growth"] == 0


@pytest.mark.parametrize("overrides, message", [
    ({"minutes": 4}, "minutes must be >= 5"),
    ({"faults": ("burst",)}, "unknown faults"),
    ({"load_fraction": 1.5}, "load_fraction"),
])
def test_bad_configs_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        SoakBenchConfig(**overrides)
