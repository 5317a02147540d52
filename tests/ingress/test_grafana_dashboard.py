"""deploy/grafana: every PromQL query of the dashboard reads series the service really exports; so does every panel
of vLLM's example Grafana dashboard (examples/online_serving/prometheus_grafana), so that a vLLM user's dashboard
works unchanged.

The exposition is the real one (`ServiceMetrics().render()` after observing requests and a
cluster snapshot, so histograms have samples); a query naming a metric, a label or a label
value that is not in it would draw an empty panel in Grafana without any error.
"""

import json
import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.ingress.metrics import ClusterSnapshot, ServiceMetrics, WorkerGauge

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "s3serve-dashboard.json"
# Prometheus adds these at scrape time; they are never in the exposition itself.
TARGET_LABELS = frozenset({"job", "instance"})
GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
IDENTIFIER = re.compile(r"(?<![\w:$])([a-zA-Z_:][\w:]*)(?![\w:])\s*(\{[^}]*\})?")
MATCHER = re.compile(r'([a-zA-Z_]\w*)\s*(=~|!=|!~|=)\s*"((?:[^"\\]|\\.)*)"')
PROMQL_WORDS = frozenset({
    "sum", "max", "min", "avg", "count", "rate", "irate", "increase", "histogram_quantile", "clamp_min",
    "clamp_max", "abs", "topk", "bottomk", "quantile", "vector", "scalar", "time", "and", "or", "unless",
    "bool", "offset",
})


def exposition(model_name: str = "") -> dict[str, list[dict[str, str]]]:
    """Sample name -> label sets, from a registry that has seen every kind of event."""
    metrics = ServiceMetrics(model_name=model_name)
    for status in ("ok", "cancelled", "error", 400, 429, 503):
        metrics.observe_status(status)
    metrics.observe_finished(ttft_s=0.2, tpot_s=0.02, latency_s=3.0, predicted_tokens=90, true_tokens=120)
    metrics.observe_finished(ttft_s=0.1, tpot_s=None, latency_s=0.1, predicted_tokens=8, true_tokens=1, priority=5)
    metrics.observe_overhead(0.004)
    metrics.set_cluster(ClusterSnapshot(
        workers=(WorkerGauge("w1", "ready", 512, 100, 300, 4, 1), WorkerGauge("w2", "starting", 0, 0, 0, 0, 0)),
        num_queued=3, num_overruns=2, num_preemptions=1, num_migrations=1, num_requeues=1))
    body, _ = metrics.render()
    samples: dict[str, list[dict[str, str]]] = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(dict(sample.labels))
    return samples


def panels(dashboard: dict) -> list[dict]:
    """Every panel, including those inside collapsed rows."""
    found = []
    for panel in dashboard["panels"]:
        found.append(panel)
        found.extend(panel.get("panels", []))
    return found


def expressions(dashboard: dict) -> list[str]:
    return [target["expr"] for panel in panels(dashboard) for target in panel.get("targets", [])]


def query_problems(expr: str, samples: dict[str, list[dict[str, str]]]) -> list[str]:
    """What in `expr` the exposition does not have: metrics, labels, exact label values."""
    problems = []
    grouping_labels = {label.strip() for group in GROUPING.findall(expr) for label in group.split(",") if label.strip()}
    bare = re.sub(r"\[[^\]]*\]", "", GROUPING.sub("", expr))  # ranges like [$__rate_interval]
    metric_names = []
    for match in IDENTIFIER.finditer(bare):
        name, matchers = match[1], match[2] or ""
        if name in PROMQL_WORDS or bare[match.end():].lstrip().startswith("("):
            continue  # a function or keyword, not a series
        metric_names.append(name)
        if name not in samples:
            problems.append(f"metric {name} is not exported")
            continue
        exported_labels = {label for labels in samples[name] for label in labels} | TARGET_LABELS
        for label, operator, value in MATCHER.findall(matchers):
            if label not in exported_labels:
                problems.append(f"{name} has no label {label}")
            elif operator == "=" and label not in TARGET_LABELS and value not in {s.get(label) for s in samples[name]}:
                problems.append(f'{name} has no series with {label}="{value}"')
    if not metric_names:
        problems.append(f"no metric in {expr!r}")
    known_labels = {label for name in metric_names for labels in samples.get(name, []) for label in labels}
    problems += [f"grouping label {label} is on none of {metric_names}"
                 for label in sorted(grouping_labels - known_labels - TARGET_LABELS)]
    if "histogram_quantile" in expr and not ("le" in grouping_labels and all(n.endswith("_bucket") for n in metric_names)):
        problems.append("histogram_quantile needs _bucket series summed by (le)")
    return problems


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


@pytest.fixture(scope="module")
def samples() -> dict[str, list[dict[str, str]]]:
    return exposition()


def test_every_query_reads_exported_series(dashboard, samples):
    exprs = expressions(dashboard)
    assert len(exprs) >= 20
    assert {expr: query_problems(expr, samples) for expr in exprs if query_problems(expr, samples)} == {}


def test_every_exported_metric_has_a_panel(dashboard, samples):
    queried = {name for expr in expressions(dashboard) for name in re.findall(r"s3_\w+", expr)}
    # ours; the vllm:* aliases are there for vLLM's own dashboards
    families = {re.sub(r"_(bucket|count|sum)$", "", name) for name in samples
                if name.startswith("s3_") and not name.endswith("_created")}
    missing = {family for family in families if not any(q.startswith(family) for q in queried)}
    assert missing == set()


def test_query_check_rejects_unknown_metrics_labels_values_and_bad_quantiles(samples):
    assert query_problems('sum(rate(s3_requests_total{status="ok"}[5m]))', samples) == []
    assert query_problems("rate(s3_request_total[5m])", samples) == ["metric s3_request_total is not exported"]
    assert query_problems('s3_kv_blocks_used{worker_id="w1"}', samples) == ["s3_kv_blocks_used has no label worker_id"]
    assert query_problems('s3_prediction_error_tokens_bucket{le="-1"}', samples) == [
        's3_prediction_error_tokens_bucket has no series with le="-1"']
    assert query_problems("sum by (state) (s3_kv_blocks_used)", samples) == [
        "grouping label state is on none of ['s3_kv_blocks_used']"]
    assert query_problems("histogram_quantile(0.5, sum(rate(s3_ttft_seconds_bucket[5m])))", samples) == [
        "histogram_quantile needs _bucket series summed by (le)"]
    # The prediction error histogram has negative buckets, so prometheus_client exports no _sum.
    assert query_problems("rate(s3_prediction_error_tokens_sum[5m])", samples) == [
        "metric s3_prediction_error_tokens_sum is not exported"]


def test_dashboard_is_importable_with_a_prometheus_datasource_variable(dashboard):
    assert dashboard["schemaVersion"] >= 36 and dashboard["uid"] and dashboard["title"]
    variables = {variable["name"]: variable for variable in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [panel["id"] for panel in panels(dashboard)]
    assert len(ids) == len(set(ids)), ids
    cells = set()
    for panel in panels(dashboard):
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24, panel["title"]
        area = {(x, y) for x in range(grid["x"], grid["x"] + grid["w"]) for y in range(grid["y"], grid["y"] + grid["h"])}
        assert not area & cells, f"{panel['title']} overlaps another panel"
        cells |= area
        if panel["type"] == "row":
            continue
        targets = panel["targets"]
        assert targets and len({t["refId"] for t in targets}) == len(targets), panel["title"]
        for source in [panel["datasource"], *(t["datasource"] for t in targets)]:
            assert source == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]


# vLLM's example dashboard, panel by panel: what each panel's queries read (metric, labels, grouping), written here
# as the dashboard writes them once its $model_name variable is chosen.
VLLM_MODEL = "smollm2-135m-instruct"
VLLM_PANELS = {
    "E2E Request Latency": [
        'histogram_quantile(0.99, sum by(le) (rate(vllm:e2e_request_latency_seconds_bucket{model_name="M"}[5m])))',
        'rate(vllm:e2e_request_latency_seconds_sum{model_name="M"}[5m]) / '
        'rate(vllm:e2e_request_latency_seconds_count{model_name="M"}[5m])'],
    "Token Throughput": ['rate(vllm:prompt_tokens_total{model_name="M"}[5m])',
                         'rate(vllm:generation_tokens_total{model_name="M"}[5m])'],
    "Time Per Output Token Latency": [
        'histogram_quantile(0.5, sum by(le) (rate(vllm:time_per_output_token_seconds_bucket{model_name="M"}[5m])))',
        'rate(vllm:time_per_output_token_seconds_sum{model_name="M"}[5m]) / '
        'rate(vllm:time_per_output_token_seconds_count{model_name="M"}[5m])'],
    "Scheduler State": ['vllm:num_requests_running{model_name="M"}', 'vllm:num_requests_waiting{model_name="M"}'],
    "Time To First Token Latency": [
        'histogram_quantile(0.9, sum by(le) (rate(vllm:time_to_first_token_seconds_bucket{model_name="M"}[5m])))',
        'rate(vllm:time_to_first_token_seconds_sum{model_name="M"}[5m]) / '
        'rate(vllm:time_to_first_token_seconds_count{model_name="M"}[5m])'],
    "Cache Utilization": ['vllm:gpu_cache_usage_perc{model_name="M"}'],
    "Request Prompt Length": ['sum by(le) (increase(vllm:request_prompt_tokens_bucket{model_name="M"}[5m]))'],
    "Request Generation Length": [
        'sum by(le) (increase(vllm:request_generation_tokens_bucket{model_name="M"}[5m]))'],
    "Finish Reason": ['sum by(finished_reason) (increase(vllm:request_success_total{model_name="M"}[5m]))'],
    "Queue Time": ['rate(vllm:request_queue_time_seconds_sum{model_name="M"}[5m])'],
    "Requests Prefill and Decode Time": ['rate(vllm:request_prefill_time_seconds_sum{model_name="M"}[5m])',
                                         'rate(vllm:request_decode_time_seconds_sum{model_name="M"}[5m])'],
    "Max Generation Token in Sequence Group": [
        'rate(vllm:request_max_num_generation_tokens_sum{model_name="M"}[5m])'],
}


@pytest.mark.parametrize("panel", sorted(VLLM_PANELS))
def test_every_panel_of_vllms_dashboard_reads_exported_series(panel):
    samples = exposition(VLLM_MODEL)
    exprs = [expr.replace('"M"', f'"{VLLM_MODEL}"') for expr in VLLM_PANELS[panel]]
    assert {expr: query_problems(expr, samples) for expr in exprs if query_problems(expr, samples)} == {}
    # the dashboard's model_name variable lists the label values of every vllm:* series
    assert {labels.get("model_name") for name, sets in samples.items() if name.startswith("vllm:")
            for labels in sets} == {VLLM_MODEL}
