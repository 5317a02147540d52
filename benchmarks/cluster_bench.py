"""`s3serve bench cluster`: the whole service over HTTP, one scheduling policy after another.

    per policy: start_service(policy, same per-worker KV budget, fresh data dir, free port)
        -> write the load plan -> `python -m benchmarks.http_load` (a separate process)
        -> controller status (per-worker generated tokens, migrations, ...) -> stop_service

Every policy gets the same trace replay: real prompt text cut to the trace's context
length, and the trace's output length forced through the service's
`forced_output_tokens` extension, while `max_tokens` is what the context leaves
(max_len - prompt), as a real client would send. max_reserve then reserves what it
would in production (prompt + max_tokens); forcing the length with `max_tokens`
alone would hand it each request's true length, making it an oracle.

A trace with Mooncake hash ids is replayed as `bench policies` does (whole sessions, each id
`tokens_per_hash_id` tokens of shared text), and the first policy runs a second time with
prefix-aware placement off (`<policy>/ffd-only`), so the table shows the workers' prefix-cache
hit rate with and without it.

`workload="natural"` sends the natural workload of `bench policies` instead: held-out pool
prompts as their chat messages, each run greedy to the model's own stop (nothing forced), at
the trace's arrival times or all at t=0, with the service's real predictor. Every policy must
give the same answer to every request (compared by a digest of the streamed text), and
`s3+probe` / `s3_peak+probe` run the policy with the workers' hidden-state probe on
(`length_probe`), as the service would with `--length-probe`.
"""

import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.cluster_bench_config import LATE, ClusterBenchConfig
from benchmarks.cluster_plan import load_plan, predictor_artifact
from benchmarks.cluster_ratios import ROUTING_MARK, ratios_against, ratios_of, routing_ratios
from benchmarks.http_load import LoadPlan, LoadRequest, RequestResult, read_results, write_plan
from benchmarks.natural_workload import compare_outputs
from benchmarks.policy_summary import PROBE_SUFFIX
from benchmarks.report import environment, format_table, percentile, write_json
from workers.actors.ports import free_port

STATS_SETTLE_S = 1.5  # the controller polls worker stats every 0.5 s; let the last poll land
TABLE_KEYS = ("tokens_per_s", "requests_per_s", "ttft_p50_s", "ttft_p99_s", "latency_mean_s", "latency_p50_s",
              "latency_p99_s",
              "worker_balance_min_max", "migrations", "rebalances", "requeues", "preemptions", "overruns",
              "overhead_p50_ms", "overhead_p99_ms", "prefix_hit_rate", "probe_reads")
FFD_ONLY_SUFFIX = "/ffd-only"  # the same policy with prefix-aware placement off


def summarize_results(results: list[RequestResult], plan: list[LoadRequest]) -> dict:
    """Client-side numbers of one policy's run: throughput over first send to last finish, percentiles."""
    forced = {r.request_id: r.forced_output_tokens for r in plan}
    by_id = {r.request_id: r for r in plan}
    ok = [r for r in results if r.is_ok]
    wall_s = (max(r.finished_s for r in results) - min(r.sent_s for r in results)) if results else 0.0
    output_tokens = sum(r.num_completion_tokens or 0 for r in ok)
    ttft = [r.first_token_s - r.sent_s for r in ok if r.first_token_s is not None]
    latency = [r.finished_s - r.sent_s for r in ok]
    overhead = [r.overhead_ms for r in results if r.overhead_ms is not None]
    errors = sorted({f"{r.status_code}: {r.error}" for r in results if not r.is_ok})
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        # None when nothing was forced (the natural workload): the model stopped on its own
        "all_outputs_exact_length": None if None in forced.values() else len(ok) == len(plan)
        and all(r.num_completion_tokens == forced[r.request_id] for r in ok),
        "hit_length_limit": sum((r.num_completion_tokens or 0) >= by_id[r.request_id].max_tokens for r in ok),
        "prompt_tokens_differ": sum(r.num_prompt_tokens != by_id[r.request_id].num_prompt_tokens for r in ok),
        "output_tokens": output_tokens,
        "wall_s": wall_s,
        "tokens_per_s": output_tokens / wall_s if wall_s else None,
        "requests_per_s": len(ok) / wall_s if wall_s else None,
        "ttft_p50_s": percentile(ttft, 0.5),
        "ttft_p99_s": percentile(ttft, 0.99),
        "latency_mean_s": sum(latency) / len(latency) if latency else None,
        "latency_p50_s": percentile(latency, 0.5),
        "latency_p99_s": percentile(latency, 0.99),
        "overhead_p50_ms": percentile(overhead, 0.5),
        "overhead_p99_ms": percentile(overhead, 0.99),
        "errors": errors[:10],
        "by_priority": _by_priority(ok, plan),
    }


def _by_priority(ok: list[RequestResult], plan: list[LoadRequest]) -> dict[str, dict]:
    """TTFT and latency percentiles per priority class (empty when every request had the same class)."""
    priority = {r.request_id: r.priority for r in plan}
    classes = sorted({r.priority for r in plan})
    if len(classes) < 2:
        return {}
    out = {}
    for cls in classes:
        mine = [r for r in ok if priority[r.request_id] == cls]
        out[str(cls)] = {"completed": len(mine),
                         "ttft_p50_s": percentile([r.first_token_s - r.sent_s for r in mine
                                                   if r.first_token_s is not None], 0.5),
                         "latency_p50_s": percentile([r.finished_s - r.sent_s for r in mine], 0.5),
                         "latency_p99_s": percentile([r.finished_s - r.sent_s for r in mine], 0.99)}
    return out


def summarize_cluster(generated_tokens_by_worker: dict[str, int], counters: dict[str, int],
                      prompt_and_hit_tokens: tuple[int, int] = (0, 0)) -> dict:
    """Per-worker balance (min/max generated tokens; 1.0 is even), the controller's event counters, and the
    workers' prefix-cache hit rate (hit / prompt tokens, summed over workers)."""
    tokens = list(generated_tokens_by_worker.values())
    num_prompt, num_hit = prompt_and_hit_tokens
    return {
        "prefix_hit_rate": num_hit / num_prompt if num_prompt else None,
        "generated_tokens_by_worker": dict(generated_tokens_by_worker),
        "worker_balance_min_max": min(tokens) / max(tokens) if tokens and max(tokens) else None,
        **{name: int(counters.get(name, 0))
           for name in ("migrations", "rebalances", "requeues", "preemptions", "overruns")},
    }


def _cell(value):
    return "n/a" if value is None else value


def _service_config(config: ClusterBenchConfig, policy: str, model_name: str, model_cache_dir: Path | None,
                    data_dir: str, artifact: str | None = None, prefix_aware_placement: bool = True):
    from cluster.config import ServiceConfig
    from cluster.control.placement import DEFAULT_LATE_BINDING

    policy, _, routing = policy.partition(ROUTING_MARK)
    late_binding = policy.endswith(LATE)  # else the service's default
    policy = policy.removesuffix(LATE)
    probe = None
    if policy.endswith(PROBE_SUFFIX):
        policy, probe = policy.removesuffix(PROBE_SUFFIX), config.probe
    return ServiceConfig(
        length_probe=probe,
        predictor_artifact=artifact, quantile=config.quantile,
        port=free_port(), model=model_name, model_cache_dir=str(model_cache_dir) if model_cache_dir else None,
        num_workers=config.num_workers, policy=policy, kv_cache_memory=config.kv_cache_bytes,
        max_model_len=config.max_len, max_num_seqs=config.max_num_seqs,
        default_max_tokens=min(256, config.max_len - 1), data_dir=data_dir, num_cpus=config.num_cpus,
        num_torch_threads=config.num_torch_threads, prefix_aware_placement=prefix_aware_placement,
        rebalance_min_gap=config.rebalance_min_gap, dtype=config.dtype, routing=routing or config.routings[0],
        late_binding=late_binding or DEFAULT_LATE_BINDING,
        # The bench measures throughput under a backlog: nothing may be refused or time out waiting for room.
        max_concurrent_requests=max(256, config.concurrency), max_pending_placements=max(128, config.concurrency),
        placement_timeout_s=24 * 3600.0)


def run_policy(config: ClusterBenchConfig, policy: str, plan: list[LoadRequest], model_name: str,
               model_cache_dir: Path | None, work_dir: Path, artifact: str | None = None,
               prefix_aware_placement: bool = True) -> dict:
    """One service with `policy`, the load from a separate process, the controller's counters; then stop."""
    import ray

    from cluster.config import CONTROLLER_NAME, RAY_NAMESPACE
    from cluster.local_ray import start_local_ray
    from cluster.service import start_service, stop_service

    label = ((policy if prefix_aware_placement else f"{policy}-ffd-only").replace(PROBE_SUFFIX, "-probe")
             .replace(LATE, "-late"))
    data_dir = work_dir / f"data-{label}"
    service_config = _service_config(config, policy, model_name, model_cache_dir, str(data_dir), artifact,
                                     prefix_aware_placement)
    print(f"{policy}: starting the service ({config.num_workers} workers, {config.kv_cache_bytes} KV bytes each)",
          flush=True)
    # Ray started here rather than in start_service only to keep the actors' logs off the bench's output.
    start_local_ray(config.num_cpus, log_to_driver=False)
    running = start_service(service_config, config.ready_timeout_s, progress=lambda _msg: None)
    try:
        plan_path, results_path = work_dir / f"plan-{label}.json", work_dir / f"results-{label}.json"
        endpoint = "chat" if config.is_natural else "completions"  # natural prompts go as their chat messages
        write_plan(plan_path, LoadPlan(running.base_url, service_config.model_id, config.concurrency, tuple(plan),
                                       endpoint))
        load = subprocess.run([sys.executable, "-m", "benchmarks.http_load", "--plan", str(plan_path),
                               "--out", str(results_path), "--desc", f"{policy} requests"])
        if load.returncode != 0:
            raise RuntimeError(f"the load generator exited with {load.returncode} (its error is printed above)")
        time.sleep(STATS_SETTLE_S)
        status = ray.get(ray.get_actor(CONTROLLER_NAME, namespace=RAY_NAMESPACE).status.remote(), timeout=60)
    finally:
        stop_service(running)
    results = read_results(results_path)
    summary = summarize_results(results, plan)
    summary.update(summarize_cluster({s.worker_id: s.num_generated_tokens for s in status.stats}, status.counters,
                                     (sum(s.num_prompt_tokens for s in status.stats),
                                      sum(s.num_prefix_hit_tokens for s in status.stats))))
    summary["probe_reads"] = sum(s.num_probe_reads for s in status.stats)
    summary["output_digests"] = {r.request_id: r.output_digest for r in results if r.is_ok}
    return summary


def run(config: ClusterBenchConfig, model_name: str = "smollm2-135m-instruct", model_cache_dir: Path | None = None,
        json_path: Path | None = None) -> dict:
    """Every policy in turn on the same replay; print the table and ratios; write JSON."""
    from workers.engine.models import load_tokenizer, resolve_model_dir

    config.check()
    tokenizer = load_tokenizer(resolve_model_dir(model_name, model_cache_dir))
    mode = "offline" if config.time_scale == 0 else "online"
    plan, shares_prefixes, workload = load_plan(config, tokenizer, mode)
    summaries = {}
    with tempfile.TemporaryDirectory(prefix="s3serve-bench-") as work_dir:
        artifact = predictor_artifact(config, plan, Path(work_dir))
        print(f"predictor: {config.predictor}" + (f" (served from {artifact})" if artifact else ""))
        runs = [policy if len(config.routings) == 1 else f"{policy}{ROUTING_MARK}{routing}"
                for policy in config.policies for routing in config.routings]
        for policy in runs:
            summaries[policy] = run_policy(config, policy, plan, model_name, model_cache_dir, Path(work_dir),
                                           artifact)
        if shares_prefixes:
            first = runs[0]
            summaries[first + FFD_ONLY_SUFFIX] = run_policy(config, first, plan, model_name, model_cache_dir,
                                                            Path(work_dir), artifact, prefix_aware_placement=False)
            ratios_extra = {"prefix_hit_rate_with_prefix_placement": summaries[first]["prefix_hit_rate"],
                            "prefix_hit_rate_ffd_only": summaries[first + FFD_ONLY_SUFFIX]["prefix_hit_rate"]}
        else:
            ratios_extra = {}
    digests = {name: s.pop("output_digests") for name, s in summaries.items()}
    answered = set.intersection(*(set(d) for d in digests.values())) if digests else set()
    # a failed request is in the table's failed column, not counted as a differing answer
    outputs = compare_outputs({name: {rid: d[rid] for rid in answered} for name, d in digests.items()})
    first_routing = f"{ROUTING_MARK}{config.routings[0]}"  # the policies' ratios: one routing's runs
    ratios = ratios_of({name.removesuffix(first_routing): s for name, s in summaries.items()
                        if ROUTING_MARK not in name or name.endswith(first_routing)})
    routing = routing_ratios(summaries)
    against_paging = ratios_against(summaries, "paged_greedy")
    late = ratios_against(summaries, LATE)
    headers = ["policy", "done", "failed", "tok/s", "req/s", "ttft_p50", "ttft_p99", "lat_mean", "lat_p50", "lat_p99",
               "balance", "migr", "rebal", "requeue", "preempt", "overrun", "ovh_p50_ms", "ovh_p99_ms", "prefix_hit",
               "probe_reads"]
    table_rows = [[name, s["completed"], s["failed"], *(_cell(s[key]) for key in TABLE_KEYS)]
                  for name, s in summaries.items()]
    print(format_table(headers, table_rows))
    if ratios:
        print(format_table(["ratio", "value"], [[k, _cell(v)] for k, v in ratios.items()]))
    if routing:
        print(format_table(["run", "vs room: tok/s", "lat_mean", "lat_p99", "ttft_p50"],
                           [[name, *(_cell(v) for v in values.values())] for name, values in routing.items()]))
    for title, compared in (("vs paged_greedy", against_paging), ("late binding vs without", late)):
        if compared:
            print(format_table(["run", f"{title}: tok/s", "lat_mean", "lat_p99", "ttft_p50"],
                               [[name, *(_cell(v) for v in values.values())] for name, values in compared.items()]))
    by_class = [[name, cls, c["completed"], _cell(c["ttft_p50_s"]), _cell(c["latency_p50_s"]),
                 _cell(c["latency_p99_s"])] for name, s in summaries.items() for cls, c in s["by_priority"].items()]
    if by_class:
        print(format_table(["policy", "priority", "done", "ttft_p50", "lat_p50", "lat_p99"], by_class))
    if ratios_extra:
        print(format_table(["prefix-cache hit rate", "value"], [[k, _cell(v)] for k, v in ratios_extra.items()]))
    for name, s in summaries.items():
        if s["failed"] or s["all_outputs_exact_length"] is False or s["prompt_tokens_differ"]:
            print(f"{name}: {s['failed']} failed, exact lengths: {s['all_outputs_exact_length']}, "
                  f"{s['prompt_tokens_differ']} prompts counted differently by the service; {s['errors'][:3]}")
    if config.is_natural:
        print(f"answers: {'identical under every policy' if outputs['identical'] else 'DIFFER'} (reference "
              f"{outputs['reference']}); at the length limit: "
              + ", ".join(f"{name} {s['hit_length_limit']}/{s['completed']}" for name, s in summaries.items()))
        for name, ids in outputs["differing"].items():
            print(f"  {name}: {len(ids)} answers differ from {outputs['reference']}'s (first: {ids[:3]})")
    result = {
        "benchmark": "cluster",
        "model": model_name,
        "trace": str(config.trace_path),
        "mode": mode,
        "time_scale": config.time_scale,
        "num_requests": len(plan),
        "num_workers": config.num_workers,
        "max_len": config.max_len,
        "kv_cache_bytes_per_worker": config.kv_cache_bytes,
        "concurrency": config.concurrency,
        "rebalance_min_gap": config.rebalance_min_gap,
        "routings": list(config.routings),
        "dtype": config.dtype,
        "predictor": config.predictor,
        "workload": config.workload,
        ("natural" if config.is_natural else "capping"): workload,
        "outputs": outputs,
        "policies": summaries,
        "ratios": {**ratios, "routing": routing, "vs_paged_greedy": against_paging, "late_binding": late},
        "prefix_placement": ratios_extra,
        "environment": environment(),
    }
    write_json(json_path, result)
    return result
