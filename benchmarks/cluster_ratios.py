"""What `bench cluster` compares between its runs: length-aware policies against baselines, routings against room,
every run against paging, late binding against binding on arrival."""

from benchmarks.policy_summary import PROBE_SUFFIX, PROBED

ROUTING_MARK = "@"  # "s3_peak@room": a policy run with a routing other than the only one compared


def ratios_of(summaries: dict[str, dict]) -> dict[str, float | None]:
    """Each length-aware policy's tokens/s (s3, s3_peak and their probe runs) over each baseline that ran."""
    ratios = {}
    for ours in ("s3", "s3_peak", *(f"{name}{PROBE_SUFFIX}" for name in PROBED)):
        for other in ("max_reserve", "paged_greedy", "sglang_ratio"):
            if ours in summaries and other in summaries:
                mine, theirs = summaries[ours]["tokens_per_s"], summaries[other]["tokens_per_s"]
                ratios[f"{ours}_vs_{other}_tokens_per_s"] = mine / theirs if mine is not None and theirs else None
    return ratios


def routing_ratios(summaries: dict[str, dict]) -> dict[str, dict[str, float | None]]:
    """Each "policy@routing" run against the same policy's "policy@room" run: tokens/s, mean and p99 latency and
    TTFT p50 as ratios (latency below 1 is better); empty when no room run is there to compare with."""
    ratios = {}
    for name, summary in summaries.items():
        policy, mark, routing = name.partition(ROUTING_MARK)
        room = summaries.get(f"{policy}{ROUTING_MARK}room")
        if not mark or routing == "room" or room is None:
            continue
        ratios[name] = metric_ratios(summary, room)
    return ratios


def ratios_against(summaries: dict[str, dict], baseline: str) -> dict[str, dict[str, float | None]]:
    """Runs against another run: tokens/s, mean and p99 latency and TTFT p50 as ratios (latency below 1 is better).

    `baseline` names a policy ("paged_greedy": every other run against its run) or a suffix ("/late": each run so
    named against the same run without it); with several routings ("s3_peak/late@room") runs pair within one
    routing. Keyed by the compared run; empty when nothing pairs.
    """
    pairs = []
    for name in summaries:
        policy, mark, routing = name.partition(ROUTING_MARK)
        if policy.endswith(baseline):
            pairs.append((name, f"{policy.removesuffix(baseline)}{mark}{routing}"))
        elif policy != baseline and not baseline.startswith("/"):
            pairs.append((name, f"{baseline}{mark}{routing}"))
    return {name: metric_ratios(summaries[name], summaries[base]) for name, base in pairs if base in summaries}


def metric_ratios(run: dict, base: dict) -> dict[str, float | None]:
    """`run` against `base`: tokens/s, mean and p99 latency and TTFT p50 (None where either has no value)."""
    return {key: run[key] / base[key] if run[key] is not None and base[key] else None
            for key in ("tokens_per_s", "latency_mean_s", "latency_p99_s", "ttft_p50_s")}
