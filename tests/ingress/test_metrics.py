"""The service's Prometheus metrics, read back through prometheus_client's own parser."""

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.ingress.metrics import ClusterSnapshot, ServiceMetrics, WorkerGauge


def samples(metrics: ServiceMetrics) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of the rendered text."""
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain")
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(body.decode())
        for sample in family.samples
    }


def make_worker(worker_id: str, state: str = "ready", num_used_blocks: int = 10) -> WorkerGauge:
    return WorkerGauge(
        worker_id=worker_id, state=state, num_total_blocks=100, num_used_blocks=num_used_blocks,
        num_reserved_blocks=num_used_blocks + 5, num_running=2, num_waiting=1,
    )


def test_request_status_labels():
    metrics = ServiceMetrics()
    for status in ("ok", "ok", 200, "cancelled", "error", 429, "429", 400, 503, "replayed"):
        metrics.observe_status(status)
    values = samples(metrics)
    expected = {"ok": 3, "cancelled": 1, "error": 1, "429": 2, "400": 1, "503": 1, "replayed": 1}
    for label, count in expected.items():
        assert values[("s3_requests_total", (("status", label),))] == count
    for bad in ("fine", 302, 99, True, "200"):
        with pytest.raises(ValueError, match="status"):
            metrics.observe_status(bad)


def test_finished_request_histograms():
    metrics = ServiceMetrics()
    metrics.observe_finished(ttft_s=0.2, tpot_s=0.02, latency_s=3.0, predicted_tokens=90, true_tokens=100)
    metrics.observe_finished(ttft_s=0.03, tpot_s=None, latency_s=0.03, predicted_tokens=None, true_tokens=1)
    metrics.observe_finished(ttft_s=0.1, tpot_s=0.01, latency_s=1.0, predicted_tokens=120, true_tokens=100)
    metrics.observe_overhead(0.004)
    values = samples(metrics)
    assert values[("s3_ttft_seconds_count", ())] == 3
    assert values[("s3_ttft_seconds_sum", ())] == pytest.approx(0.33)
    assert values[("s3_ttft_seconds_bucket", (("le", "0.05"),))] == 1
    assert values[("s3_tpot_seconds_count", ())] == 2  # a one-token answer has no TPOT
    assert values[("s3_request_latency_seconds_bucket", (("le", "1.0"),))] == 2
    # Signed errors: -10 (under-predicted) and +20 (over-predicted); the request without
    # a prediction is not counted.
    assert values[("s3_prediction_error_tokens_count", ())] == 2
    assert values[("s3_prediction_error_tokens_bucket", (("le", "-16.0"),))] == 0
    assert values[("s3_prediction_error_tokens_bucket", (("le", "-8.0"),))] == 1
    assert values[("s3_prediction_error_tokens_bucket", (("le", "0.0"),))] == 1
    assert values[("s3_prediction_error_tokens_bucket", (("le", "16.0"),))] == 1
    assert values[("s3_prediction_error_tokens_bucket", (("le", "32.0"),))] == 2
    assert values[("s3_router_overhead_seconds_bucket", (("le", "0.005"),))] == 1
    assert values[("s3_router_overhead_seconds_bucket", (("le", "0.0025"),))] == 0


def test_prediction_error_buckets_are_symmetric():
    values = samples(ServiceMetrics())
    edges = [
        float(dict(labels)["le"])
        for name, labels in values
        if name == "s3_prediction_error_tokens_bucket" and dict(labels)["le"] != "+Inf"
    ]
    assert 0.0 in edges and sorted(edges) == sorted(-edge for edge in edges)


def test_cluster_snapshot_gauges_and_counters():
    metrics = ServiceMetrics()
    values = samples(metrics)
    # Before any snapshot: zero totals and queue, no per-worker series.
    assert values[("s3_queue_depth", ())] == 0
    assert values[("s3_migrations_total", ())] == 0
    assert not any(name == "s3_kv_blocks_used" for name, _ in values)

    metrics.set_cluster(
        ClusterSnapshot(
            workers=(make_worker("w0", num_used_blocks=30), make_worker("w1", num_used_blocks=7),
                     make_worker("w2", state="starting", num_used_blocks=0)),
            num_queued=4, num_overruns=9, num_preemptions=3, num_migrations=2, num_requeues=1,
        )
    )
    values = samples(metrics)
    assert values[("s3_kv_blocks_used", (("worker", "w0"),))] == 30
    assert values[("s3_kv_blocks_used", (("worker", "w1"),))] == 7
    assert values[("s3_kv_blocks_reserved", (("worker", "w1"),))] == 12
    assert values[("s3_kv_blocks_total", (("worker", "w2"),))] == 100
    assert values[("s3_worker_running", (("worker", "w0"),))] == 2
    assert values[("s3_worker_waiting", (("worker", "w0"),))] == 1
    assert values[("s3_queue_depth", ())] == 4
    assert values[("s3_workers", (("state", "ready"),))] == 2
    assert values[("s3_workers", (("state", "starting"),))] == 1
    totals = {"s3_overruns_total": 9, "s3_preemptions_total": 3, "s3_migrations_total": 2, "s3_requeues_total": 1}
    for name, total in totals.items():
        assert values[(name, ())] == total

    # The counters mirror the controller's totals; a worker that left disappears.
    metrics.set_cluster(ClusterSnapshot(workers=(make_worker("w1"),), num_queued=0, num_overruns=12))
    values = samples(metrics)
    assert values[("s3_overruns_total", ())] == 12
    assert ("s3_kv_blocks_used", (("worker", "w0"),)) not in values
    assert ("s3_workers", (("state", "starting"),)) not in values
    assert values[("s3_workers", (("state", "ready"),))] == 1


def test_instances_do_not_share_state():
    first, second = ServiceMetrics(), ServiceMetrics()
    first.observe_status("ok")
    assert ("s3_requests_total", (("status", "ok"),)) not in samples(second)


def test_snapshot_validation():
    with pytest.raises(ValueError, match="num_queued"):
        ClusterSnapshot(num_queued=-1)
    with pytest.raises(ValueError, match="repeat"):
        ClusterSnapshot(workers=(make_worker("w0"), make_worker("w0")))


def test_latency_is_also_kept_per_priority_class():
    metrics = ServiceMetrics()
    metrics.observe_finished(ttft_s=0.1, tpot_s=0.01, latency_s=1.0, predicted_tokens=None, true_tokens=5)
    metrics.observe_finished(ttft_s=0.5, tpot_s=0.01, latency_s=4.0, predicted_tokens=None, true_tokens=5, priority=5)
    metrics.observe_finished(ttft_s=0.7, tpot_s=0.01, latency_s=6.0, predicted_tokens=None, true_tokens=5, priority=5)
    values = samples(metrics)
    assert values[("s3_class_request_latency_seconds_count", (("priority", "0"),))] == 1
    assert values[("s3_class_request_latency_seconds_count", (("priority", "5"),))] == 2
    assert values[("s3_class_request_latency_seconds_sum", (("priority", "5"),))] == pytest.approx(10.0)
    assert values[("s3_class_ttft_seconds_sum", (("priority", "0"),))] == pytest.approx(0.1)
    assert values[("s3_request_latency_seconds_count", ())] == 3  # the all-classes series is unchanged


def test_vllm_names_a_vllm_users_dashboards_read_are_exported_beside_ours():
    metrics = ServiceMetrics(model_name="smollm2")
    metrics.set_cluster(ClusterSnapshot(workers=(make_worker("w0", num_used_blocks=30), make_worker("w1")),
                                        num_queued=3, num_preemptions=4, num_prefix_query_tokens=90,
                                        num_prefix_hit_tokens=32))
    metrics.observe_finished(0.2, 0.01, 1.5, 40, 37, num_prompt_tokens=12, queued_s=0.3)
    metrics.observe_finished(0.4, None, 0.4, None, 1, num_prompt_tokens=5, finish_reason="length")
    values = samples(metrics)
    label = (("model_name", "smollm2"),)
    assert values[("vllm:num_requests_running", label)] == 4  # 2 running on each worker
    assert values[("vllm:num_requests_waiting", label)] == 3 + 2  # placement queue + each worker's one waiting
    assert values[("vllm:kv_cache_usage_perc", label)] == pytest.approx(40 / 200)  # a fraction, as vLLM's
    assert values[("vllm:prompt_tokens_total", label)] == 17
    assert values[("vllm:generation_tokens_total", label)] == 38
    assert values[("vllm:time_to_first_token_seconds_count", label)] == 2
    assert values[("vllm:e2e_request_latency_seconds_sum", label)] == pytest.approx(1.9)
    assert values[("vllm:e2e_request_latency_seconds_bucket", (("le", "0.5"), *label))] == 1
    assert values[("vllm:request_success_total", (("finished_reason", "stop"), *label))] == 1
    assert values[("vllm:request_success_total", (("finished_reason", "length"), *label))] == 1
    assert values[("vllm:inter_token_latency_seconds_count", label)] == 1  # once per request of 2 tokens or more
    assert values[("vllm:request_queue_time_seconds_sum", label)] == pytest.approx(0.3)
    assert values[("vllm:num_preemptions_total", label)] == 4
    assert (values[("vllm:prefix_cache_queries_total", label)], values[("vllm:prefix_cache_hits_total", label)]) == \
        (90, 32)
