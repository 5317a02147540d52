"""`bench simulate`'s ratios: the best length-aware policy against each baseline, and one setting against another
(routing against room alone, late binding against binding on arrival)."""

from benchmarks.cluster_ratios import metric_ratios
from benchmarks.policy_summary import BASELINES

LENGTH_AWARE = ("s3", "s3_peak")  # the simulator runs no probe
PAPER_S3_VS_MAX_RESERVE = 6.49  # the S3 paper's headline throughput ratio


def policy_ratios(runs: list[dict], worker_counts: tuple[int, ...], key: str) -> dict:
    """Best length-aware policy by `key` over each baseline that ran, at the largest cluster and per size."""
    by = {(r["num_workers"], r["policy"]): r[key] for r in runs}
    ratios: dict = {}
    per_size: dict = {}
    for num_workers in worker_counts:
        ours = [(by[(num_workers, p)], p) for p in LENGTH_AWARE if (num_workers, p) in by]
        if not ours:
            continue
        best, name = max(ours)
        row = {"best_length_aware": name}
        for other in BASELINES:
            if (num_workers, other) in by and by[(num_workers, other)]:
                row[f"s3_vs_{other}"] = best / by[(num_workers, other)]
        per_size[str(num_workers)] = row
    if per_size:
        largest = per_size[str(max(int(n) for n in per_size))]
        ratios.update({k: v for k, v in largest.items()})
        ratios["at_num_workers"] = max(int(n) for n in per_size)
        ratios["paper_s3_vs_max_reserve"] = PAPER_S3_VS_MAX_RESERVE
        ratios["by_num_workers"] = per_size
    return ratios


def ratios_against(runs: list[dict], axis: str, baseline: str) -> dict[str, dict[str, float]]:
    """Each run against the one that differs only in `axis` ("routing" or "binding"), set to `baseline`:
    "<workers>/<policy>/<routing>" -> tokens/s, mean and p99 latency and TTFT p50, as ratios (latency below 1 is
    better)."""
    keys = ("num_workers", "policy", "routing", "binding")
    by = {tuple(r[k] for k in keys): r for r in runs}
    ratios = {}
    for key, run in by.items():
        base = by.get(tuple(baseline if k == axis else v for k, v in zip(keys, key)))
        if run[axis] == baseline or base is None:
            continue
        ratios["/".join(str(v) for v in key[:3])] = metric_ratios(run, base)
    return ratios
