"""What `bench policies` reports of its runs: per-policy summaries and the ratios between policies."""

from benchmarks.report import percentile

NO_CACHE_SUFFIX = "/no-cache"  # a run with the prefix cache off, e.g. "paged_greedy/no-cache"
CACHE_COMPARED = ("paged_greedy", "s3", "s3_peak")  # run with the cache off too when the trace shares prefixes
PROBE_SUFFIX = "+probe"  # a length-aware policy whose bounds the worker-side probe refines
PROBED = ("s3", "s3_peak")  # run again with the hidden-state probe when one is given
# policies that use the predictor (the oracle is an instrument, never "best"); "+probe": bounds refined in the worker
LENGTH_AWARE = ("s3", "s3_peak", "s3+probe", "s3_peak+probe")
BASELINES = ("max_reserve", "paged_greedy", "sglang_ratio")
STEP_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def step_ms_by_batch(steps: list[tuple[float, float, int, int, int]]) -> dict[str, float]:
    """Mean step time (ms) by sequences in the step, in power-of-two buckets ("4" = 4..7); idle gaps left out.

    Steps mix prefill chunks and decodes (continuous batching), as served."""
    sums: dict[int, list[float]] = {}
    for _, duration_s, num_seqs, _, _ in steps:
        if num_seqs <= 0:
            continue
        bucket = max(b for b in STEP_BATCH_BUCKETS if b <= num_seqs)
        sums.setdefault(bucket, []).append(duration_s)
    return {str(b): 1000.0 * sum(v) / len(v) for b, v in sorted(sums.items())}


def _time_mean(run, column: int) -> float:
    """Mean of a step column weighted by step duration (idle gaps count as zero)."""
    total_s = sum(step[1] for step in run.steps)
    return sum(step[1] * step[column] for step in run.steps) / total_s if total_s else 0.0


def summarize(run, num_requests: int) -> dict:
    """The reported metrics of one `PolicyRun`."""
    return {
        "tokens_per_s": run.output_tokens / run.wall_s,
        "requests_per_s": num_requests / run.wall_s,
        "wall_s": run.wall_s,
        "output_tokens": run.output_tokens,
        "all_outputs_exact_length": run.outputs_ok,
        "mean_concurrency": _time_mean(run, 2),
        "max_concurrency": max((step[2] for step in run.steps), default=0),
        "kv_blocks_total": run.num_blocks,
        "kv_used_fraction_mean": _time_mean(run, 3) / run.num_blocks,
        "kv_reserved_fraction_mean": _time_mean(run, 4) / run.num_blocks,
        "preemptions": run.num_preemptions,
        "recomputed_tokens": run.num_recomputed_tokens,
        "swapped_bytes": run.swapped_bytes,
        "swap_space_peak_bytes": run.swap_space_peak_bytes,
        "swaps_over_budget": run.num_swaps_over_budget,
        "mispredictions": run.num_mispredictions,
        "probe_reads": run.num_probe_reads,
        "misprediction_events": run.misprediction_events,
        "latency_mean_s": sum(run.latency_s) / len(run.latency_s) if run.latency_s else None,
        "latency_p50_s": percentile(run.latency_s, 0.5),
        "latency_p99_s": percentile(run.latency_s, 0.99),
        "ttft_p50_s": percentile(run.ttft_s, 0.5),
        "ttft_p99_s": percentile(run.ttft_s, 0.99),
        "tpot_p50_s": percentile(run.tpot_s, 0.5),
        "prefix_caching": run.prefix_caching,
        "prefix_hit_rate": _ratio(run.num_prefix_hit_tokens, run.num_prompt_tokens),
        "step_ms_by_batch": step_ms_by_batch(run.steps),
    }


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def best_ratios(summaries: dict[str, dict]) -> dict:
    """The length-aware policy with the most tokens/s against each baseline: `best_vs_<baseline>`, plus its
    p99 latency and recomputed tokens relative to paged_greedy's."""
    candidates = [name for name in LENGTH_AWARE if name in summaries]
    if not candidates:
        return {}
    best = max(candidates, key=lambda name: summaries[name]["tokens_per_s"])
    ratios: dict = {"best_policy": best}
    for other in BASELINES:
        if other in summaries:
            ratios[f"best_vs_{other}"] = _ratio(summaries[best]["tokens_per_s"], summaries[other]["tokens_per_s"])
    if "paged_greedy" in summaries:
        paged = summaries["paged_greedy"]
        ratios["best_vs_paged_greedy_latency_p99"] = _ratio(summaries[best]["latency_p99_s"], paged["latency_p99_s"])
        ratios["best_vs_paged_greedy_recomputed_tokens"] = _ratio(summaries[best]["recomputed_tokens"],
                                                                  paged["recomputed_tokens"])
    return ratios


def policy_ratios(summaries: dict[str, dict]) -> dict:
    """Each length-aware policy against each baseline and the oracle, the best one's ratios, and prefix
    caching on vs off where both ran."""
    ratios = {}
    for ours in LENGTH_AWARE:
        if ours not in summaries:
            continue
        mine = summaries[ours]
        for other in (*BASELINES, "oracle"):
            if other in summaries:
                ratios[f"{ours}_vs_{other}"] = _ratio(mine["tokens_per_s"], summaries[other]["tokens_per_s"])
        if "max_reserve" in summaries:
            ratios[f"{ours}_vs_max_reserve_concurrency"] = _ratio(
                mine["mean_concurrency"], summaries["max_reserve"]["mean_concurrency"])
        if "paged_greedy" in summaries:
            ratios[f"{ours}_vs_paged_greedy_recomputed_tokens"] = _ratio(
                mine["recomputed_tokens"], summaries["paged_greedy"]["recomputed_tokens"])
            ratios[f"{ours}_vs_paged_greedy_latency_p99"] = _ratio(
                mine["latency_p99_s"], summaries["paged_greedy"]["latency_p99_s"])
    ratios.update(best_ratios(summaries))
    on_vs_off = {name: _ratio(summaries[name]["tokens_per_s"], summaries[name + NO_CACHE_SUFFIX]["tokens_per_s"])
                 for name in CACHE_COMPARED if name in summaries and name + NO_CACHE_SUFFIX in summaries}
    if on_vs_off:
        best = max(on_vs_off, key=lambda name: summaries[name]["tokens_per_s"])
        ratios["prefix_cache_on_vs_off"] = on_vs_off[best]
        ratios["prefix_cache_on_vs_off_policy"] = best
        ratios.update({f"prefix_cache_on_vs_off_{name}": value for name, value in on_vs_off.items()})
    return ratios
