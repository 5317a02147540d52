"""Prometheus metrics of the service, served by the router at `GET /metrics`.

Two sources:
- the router observes each request it answers (status, TTFT, TPOT, latency, prediction
  error, its own overhead) into counters and histograms it owns;
- the controller owns the cluster's state and its cumulative counts (overruns,
  preemptions, migrations, requeues, kept in Redis so they survive restarts). The router
  hands its latest `ClusterSnapshot` to `set_cluster`, and a custom collector renders it:
  gauges per worker, and counters that mirror the controller's totals (a counter we
  incremented ourselves would double count across router replicas and restarts).

`s3_requests_total{status}` labels, one per outcome:
  "ok"         answered in full (2xx, streamed or not)
  "cancelled"  the client went away before the end (its blocks were freed)
  "error"      failed after the response had started (e.g. a stream cut by a bug)
  "replayed"   a retry with an Idempotency-Key answered with the first request's kept answer (nothing generated)
  "400".."599" refused with that HTTP status (400 bad input, 429 queue full, ...)
Exact codes rather than "4xx" because 429 (overload) and 400 (client bug) call for
different reactions; the set of codes the router answers is small, so is the cardinality.
"""

from collections import Counter as Tally
from dataclasses import dataclass

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

_OUTCOMES = frozenset({"ok", "cancelled", "error", "replayed"})
_TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_LATENCY_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
_TOKEN_COUNT_BUCKETS = tuple(m * 10**e for e in range(6) for m in (1, 2, 5))  # 1 to 500,000 tokens (vLLM's 1-2-5)
_OVERHEAD_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
# predicted - true, in tokens: negative = under-prediction (overrun risk), positive =
# over-reservation. Edges mirror each other around 0. prometheus_client drops `_sum` from
# a histogram with negative buckets (OpenMetrics: a sum that can fall is no counter), so
# read the bias from the buckets.
_ERROR_MAGNITUDES = (1, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
_PREDICTION_ERROR_BUCKETS = tuple(-m for m in reversed(_ERROR_MAGNITUDES)) + (0,) + _ERROR_MAGNITUDES


@dataclass(frozen=True, slots=True)
class WorkerGauge:
    """One worker's state as the controller last saw it.

    Attributes:
        worker_id: stable id, the `worker` label.
        state: lifecycle state ("starting", "ready", "draining", "dead", ...).
        num_total_blocks: KV blocks of its pool.
        num_used_blocks: blocks holding KV now.
        num_reserved_blocks: blocks promised to admitted requests (used or not yet).
        num_running: sequences in its running batch.
        num_waiting: sequences queued on it.
    """

    worker_id: str
    state: str
    num_total_blocks: int
    num_used_blocks: int
    num_reserved_blocks: int
    num_running: int
    num_waiting: int


@dataclass(frozen=True, slots=True)
class ClusterSnapshot:
    """The cluster's state and the controller's cumulative counts at one moment.

    Attributes:
        workers: one gauge per known worker.
        num_queued: requests admitted by the router and not yet placed on a worker.
        num_overruns: sequences that outgrew their reservation, since the service began.
        num_preemptions: sequences preempted, since the service began.
        num_migrations: sequences moved to another worker, since the service began.
        num_requeues: requests re-placed after their worker died, since the service began.
        num_prefix_query_tokens: prompt tokens the workers looked up in their prefix caches, summed over the workers
            now known (each counts since it started).
        num_prefix_hit_tokens: of those, tokens found cached.
    """

    workers: tuple[WorkerGauge, ...] = ()
    num_queued: int = 0
    num_overruns: int = 0
    num_preemptions: int = 0
    num_migrations: int = 0
    num_requeues: int = 0
    num_prefix_query_tokens: int = 0
    num_prefix_hit_tokens: int = 0

    def __post_init__(self):
        for name in ("num_queued", "num_overruns", "num_preemptions", "num_migrations", "num_requeues",
                     "num_prefix_query_tokens", "num_prefix_hit_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        worker_ids = [str(worker.worker_id) for worker in self.workers]
        if len(set(worker_ids)) != len(worker_ids):
            raise ValueError(f"worker ids repeat: {worker_ids}")


class _ClusterCollector(Collector):
    """Renders the latest ClusterSnapshot; workers that left it leave the output too. Also as vLLM's gauges, which
    a vLLM user's dashboards and autoscaling rules read (summed over workers, labelled with the model's name)."""

    def __init__(self, model_name: str = ""):
        self.snapshot = ClusterSnapshot()
        self.model_name = model_name

    def collect(self):
        snapshot = self.snapshot  # one read: set_cluster may replace it meanwhile
        per_worker = {
            "s3_kv_blocks_used": ("KV blocks holding KV, per worker.", "num_used_blocks"),
            "s3_kv_blocks_reserved": ("KV blocks reserved for admitted requests, per worker.", "num_reserved_blocks"),
            "s3_kv_blocks_total": ("KV blocks in the pool, per worker.", "num_total_blocks"),
            "s3_worker_running": ("Sequences in the running batch, per worker.", "num_running"),
            "s3_worker_waiting": ("Sequences queued on the worker, per worker.", "num_waiting"),
        }
        for name, (documentation, attribute) in per_worker.items():
            family = GaugeMetricFamily(name, documentation, labels=["worker"])
            for worker in snapshot.workers:
                family.add_metric([str(worker.worker_id)], getattr(worker, attribute))
            yield family
        yield GaugeMetricFamily("s3_queue_depth", "Requests waiting for placement.", value=snapshot.num_queued)
        by_state = GaugeMetricFamily("s3_workers", "Workers, by lifecycle state.", labels=["state"])
        for state, count in sorted(Tally(worker.state for worker in snapshot.workers).items()):
            by_state.add_metric([state], count)
        yield by_state
        totals = {
            "s3_overruns": ("Sequences that outgrew their reservation.", snapshot.num_overruns),
            "s3_preemptions": ("Sequences preempted.", snapshot.num_preemptions),
            "s3_migrations": ("Sequences moved to another worker.", snapshot.num_migrations),
            "s3_requeues": ("Requests re-placed after their worker died.", snapshot.num_requeues),
        }
        for name, (documentation, total) in totals.items():
            yield CounterMetricFamily(name, documentation, value=total)
        yield from self._vllm_gauges(snapshot)

    def _vllm_gauges(self, snapshot: ClusterSnapshot):
        workers = snapshot.workers
        total_blocks = sum(worker.num_total_blocks for worker in workers)
        vllm = {
            "vllm:num_requests_running": ("Requests in the workers' running batches (vLLM's name).",
                                          sum(worker.num_running for worker in workers)),
            "vllm:num_requests_waiting": ("Requests waiting: for placement or in a worker's queue (vLLM's name).",
                                          snapshot.num_queued + sum(worker.num_waiting for worker in workers)),
            "vllm:kv_cache_usage_perc": ("KV-cache usage, 1 meaning full, over every worker (vLLM's name).",
                                         sum(worker.num_used_blocks for worker in workers) / total_blocks
                                         if total_blocks else 0.0),
        }
        # vLLM's earlier name, which its example Grafana dashboard still reads
        vllm["vllm:gpu_cache_usage_perc"] = ("KV-cache usage (vLLM's earlier name of vllm:kv_cache_usage_perc).",
                                             vllm["vllm:kv_cache_usage_perc"][1])
        for name, (documentation, value) in vllm.items():
            family = GaugeMetricFamily(name, documentation, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
        vllm_totals = {
            "vllm:num_preemptions": ("Sequences preempted (vLLM's name).", snapshot.num_preemptions),
            "vllm:prefix_cache_queries": ("Prompt tokens looked up in the prefix caches (vLLM's name).",
                                          snapshot.num_prefix_query_tokens),
            "vllm:prefix_cache_hits": ("Prompt tokens found in the prefix caches (vLLM's name).",
                                       snapshot.num_prefix_hit_tokens),
        }
        for name, (documentation, total) in vllm_totals.items():
            family = CounterMetricFamily(name, documentation, labels=["model_name"])
            family.add_metric([self.model_name], total)
            yield family


class ServiceMetrics:
    """The service's Prometheus metrics in a registry of their own (no global state).

    Args:
        registry: where to register; a fresh one by default, so that several instances
            (tests, several apps in one process) never clash.
        model_name: the served model's id, the `model_name` label of the metrics under vLLM's names
            (`vllm:*`), exported beside ours so that a vLLM user's dashboards read this service too.
    """

    def __init__(self, registry: CollectorRegistry | None = None, model_name: str = ""):
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name
        labelled = {"labelnames": ["model_name"], "registry": self.registry}
        self._vllm_prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of finished requests (vLLM's name).",
                                           **labelled)
        self._vllm_generation_tokens = Counter("vllm:generation_tokens",
                                               "Tokens generated by finished requests (vLLM's name).", **labelled)
        self._vllm_ttft_s = Histogram("vllm:time_to_first_token_seconds", "Time to first token (vLLM's name).",
                                      buckets=_TTFT_BUCKETS_S, **labelled)
        self._vllm_latency_s = Histogram("vllm:e2e_request_latency_seconds", "Arrival to last token (vLLM's name).",
                                         buckets=_LATENCY_BUCKETS_S, **labelled)
        self._vllm_success = Counter("vllm:request_success", "Finished requests, by finish reason (vLLM's name).",
                                     labelnames=["model_name", "finished_reason"], registry=self.registry)
        self._vllm_inter_token_s = Histogram(
            "vllm:inter_token_latency_seconds", "Time between output tokens (vLLM's name; here each request's mean "
            "gap, once per request).", buckets=_TPOT_BUCKETS_S, **labelled)
        self._vllm_queue_s = Histogram("vllm:request_queue_time_seconds",
                                       "Time waiting for KV room before placement (vLLM's name).",
                                       buckets=_LATENCY_BUCKETS_S, **labelled)
        # The rest of what vLLM's example Grafana dashboard reads, per finished request.
        self._vllm_tpot_s = Histogram(
            "vllm:time_per_output_token_seconds", "Each request's mean time per output token after the first "
            "(vLLM's earlier name of vllm:inter_token_latency_seconds).", buckets=_TPOT_BUCKETS_S, **labelled)
        self._vllm_prompt_lengths = Histogram("vllm:request_prompt_tokens", "Prompt tokens per request (vLLM's name).",
                                              buckets=_TOKEN_COUNT_BUCKETS, **labelled)
        self._vllm_output_lengths = Histogram("vllm:request_generation_tokens",
                                              "Tokens generated per request (vLLM's name).",
                                              buckets=_TOKEN_COUNT_BUCKETS, **labelled)
        self._vllm_max_output_lengths = Histogram(
            "vllm:request_max_num_generation_tokens", "Tokens generated by the longest choice of a request (vLLM's "
            "name; here each choice counts as a request).", buckets=_TOKEN_COUNT_BUCKETS, **labelled)
        self._vllm_prefill_s = Histogram("vllm:request_prefill_time_seconds",
                                         "First token's time after placement (vLLM's name).",
                                         buckets=_LATENCY_BUCKETS_S, **labelled)
        self._vllm_decode_s = Histogram("vllm:request_decode_time_seconds",
                                        "First token to last (vLLM's name).", buckets=_LATENCY_BUCKETS_S, **labelled)
        self._requests = Counter(
            "s3_requests", "Requests answered, by outcome (see cluster/ingress/metrics.py).", ["status"],
            registry=self.registry,
        )
        self._ttft_s = Histogram(
            "s3_ttft_seconds", "Time to first token.", buckets=_TTFT_BUCKETS_S, registry=self.registry
        )
        self._tpot_s = Histogram(
            "s3_tpot_seconds", "Time per output token after the first.", buckets=_TPOT_BUCKETS_S,
            registry=self.registry,
        )
        self._latency_s = Histogram(
            "s3_request_latency_seconds", "Arrival to last token.", buckets=_LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self._class_ttft_s = Histogram(
            "s3_class_ttft_seconds", "Time to first token, per priority class (lower is more urgent).",
            ["priority"], buckets=_TTFT_BUCKETS_S, registry=self.registry,
        )
        self._class_latency_s = Histogram(
            "s3_class_request_latency_seconds", "Arrival to last token, per priority class (lower is more urgent).",
            ["priority"], buckets=_LATENCY_BUCKETS_S, registry=self.registry,
        )
        self._prediction_error_tokens = Histogram(
            "s3_prediction_error_tokens", "Predicted output length (point) minus the true one, in tokens.",
            buckets=_PREDICTION_ERROR_BUCKETS, registry=self.registry,
        )
        self._overhead_s = Histogram(
            "s3_router_overhead_seconds", "Router + predictor + placement time of a request.",
            buckets=_OVERHEAD_BUCKETS_S, registry=self.registry,
        )
        self._cluster = _ClusterCollector(model_name)
        self.registry.register(self._cluster)

    def observe_status(self, status: str | int) -> None:
        """Counts one answered request: "ok", "cancelled", "error", "replayed", or an HTTP status code.

        A 2xx code counts as "ok"; any other code must be an error status (400-599).
        """
        if isinstance(status, int) and not isinstance(status, bool):
            if 200 <= status < 300:
                label = "ok"
            elif 400 <= status < 600:
                label = str(status)
            else:
                raise ValueError(f"status code must be 2xx, 4xx or 5xx, got {status}")
        elif status in _OUTCOMES or isinstance(status, str) and status.isdigit() and 400 <= int(status) < 600:
            label = status
        else:
            raise ValueError(f"status must be one of {sorted(_OUTCOMES)} or an HTTP error code, got {status!r}")
        self._requests.labels(status=label).inc()

    def observe_finished(
        self,
        ttft_s: float,
        tpot_s: float | None,
        latency_s: float,
        predicted_tokens: int | None,
        true_tokens: int,
        priority: int = 0,
        num_prompt_tokens: int = 0,
        finish_reason: str = "stop",
        queued_s: float = 0.0,
    ) -> None:
        """Records one finished request's timings and, when it had one, its prediction error.

        It does not count the request: call observe_status too.

        Args:
            ttft_s: arrival to first token.
            tpot_s: mean time per output token after the first; None with a single token.
            latency_s: arrival to last token.
            predicted_tokens: the predictor's point estimate; None when the policy used none.
            true_tokens: tokens actually generated.
            priority: the request's class (also observed per class).
            num_prompt_tokens: the request's prompt tokens (vLLM's prompt token counter).
            finish_reason: why it ended ("stop", "length", "abort"; vLLM's request_success label).
            queued_s: time it waited for KV room before placement.
        """
        self._ttft_s.observe(ttft_s)
        self._vllm_ttft_s.labels(model_name=self.model_name).observe(ttft_s)
        self._vllm_latency_s.labels(model_name=self.model_name).observe(latency_s)
        self._vllm_prompt_tokens.labels(model_name=self.model_name).inc(num_prompt_tokens)
        self._vllm_generation_tokens.labels(model_name=self.model_name).inc(true_tokens)
        self._vllm_success.labels(model_name=self.model_name, finished_reason=finish_reason).inc()
        self._vllm_queue_s.labels(model_name=self.model_name).observe(queued_s)
        self._vllm_prompt_lengths.labels(model_name=self.model_name).observe(num_prompt_tokens)
        self._vllm_output_lengths.labels(model_name=self.model_name).observe(true_tokens)
        self._vllm_max_output_lengths.labels(model_name=self.model_name).observe(true_tokens)
        self._vllm_prefill_s.labels(model_name=self.model_name).observe(max(ttft_s - queued_s, 0.0))
        self._vllm_decode_s.labels(model_name=self.model_name).observe(max(latency_s - ttft_s, 0.0))
        if tpot_s is not None:
            self._tpot_s.observe(tpot_s)
            self._vllm_inter_token_s.labels(model_name=self.model_name).observe(tpot_s)
            self._vllm_tpot_s.labels(model_name=self.model_name).observe(tpot_s)
        self._latency_s.observe(latency_s)
        self._class_ttft_s.labels(priority=str(priority)).observe(ttft_s)
        self._class_latency_s.labels(priority=str(priority)).observe(latency_s)
        if predicted_tokens is not None:
            self._prediction_error_tokens.observe(predicted_tokens - true_tokens)

    def observe_overhead(self, seconds: float) -> None:
        """Records the router + predictor + placement time of one request."""
        self._overhead_s.observe(seconds)

    def set_cluster(self, snapshot: ClusterSnapshot) -> None:
        """Replaces the cluster state rendered from now on."""
        self._cluster.snapshot = snapshot

    def render(self) -> tuple[bytes, str]:
        """(body, content type) of the Prometheus text exposition."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def cluster_snapshot(status):
    """The controller's status as the metrics module's snapshot."""
    stats_by_id = {s.worker_id: s for s in status.stats}
    gauges = []
    for record in status.workers:
        stats = stats_by_id.get(record.worker_id)
        gauges.append(WorkerGauge(
            worker_id=record.worker_id, state=record.state, num_total_blocks=record.num_total_blocks,
            num_used_blocks=stats.num_used_blocks if stats else 0,
            num_reserved_blocks=max(status.reserved_blocks.get(record.worker_id, 0),
                                    stats.num_reserved_blocks if stats else 0),
            num_running=stats.num_running if stats else 0, num_waiting=stats.num_waiting if stats else 0))
    counters = status.counters
    return ClusterSnapshot(
        workers=tuple(gauges), num_queued=status.num_pending,
        num_overruns=counters.get("overruns", 0), num_preemptions=counters.get("preemptions", 0),
        num_migrations=counters.get("migrations", 0), num_requeues=counters.get("requeues", 0),
        num_prefix_query_tokens=sum(s.num_prompt_tokens for s in status.stats),
        num_prefix_hit_tokens=sum(s.num_prefix_hit_tokens for s in status.stats))
