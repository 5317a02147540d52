"""One latency-bench run's measures, and the rounds' medians and ratios against FCFS paging."""

import statistics

from benchmarks.policy_replay import PolicyRun
from benchmarks.report import percentile

WAITED_S = 0.1  # a request that spent longer than this in the engine's queue counts as one that waited
LENGTH_CLASSES = ("short", "medium", "long")  # thirds of the workload's true output lengths
GAUGE_SEQUENCES = (4, 12)  # steps of this many sequences (inclusive) gauge the machine's speed: every run has them


def length_classes(lengths: dict[str, int]) -> dict[str, str]:
    """Each request's class by its true output length: the shortest third "short", the longest third "long"."""
    ordered = sorted(lengths, key=lambda rid: (lengths[rid], rid))
    third = len(ordered) / 3
    return {rid: LENGTH_CLASSES[min(2, int(index / third))] for index, rid in enumerate(ordered)}


def capacity_of(run: PolicyRun, num_requests: int) -> float:
    """Requests/s of a run with every request at t=0, until 90% of them finished."""
    done_s = sorted(run.latency_s)
    index = max(0, int(0.9 * num_requests) - 1)
    return (index + 1) / done_s[index]


def step_ms(run: PolicyRun, band: tuple[int, int] = GAUGE_SEQUENCES) -> float | None:
    """The machine's speed during a run: the median wall-clock duration (ms) of its steps that held `band`
    sequences (on the wall clock even where the run counted modelled time). The same kernels run under every policy,
    so between two runs of one point a ratio far from 1 is the machine drifting (or a policy's own host time per
    step), not the order it chose."""
    durations = [duration_s for shape, duration_s in run.measured_steps if band[0] <= shape.num_seqs <= band[1]]
    return 1e3 * statistics.median(durations) if durations else None


def summarize(run: PolicyRun, classes: dict[str, str]) -> dict:
    """What one run measured (seconds, tokens/s, counts)."""
    latency, queue = run.latency_s, run.queue_s
    by_class = {name: [s for rid, s in run.latency_s_by_request.items() if classes[rid] == name]
                for name in LENGTH_CLASSES}
    return {"policy": run.policy, "wall_s": run.wall_s, "tokens_per_s": run.output_tokens / run.wall_s,
            "latency_mean_s": sum(latency) / len(latency), "latency_p50_s": percentile(latency, 0.5),
            "latency_p99_s": percentile(latency, 0.99), "ttft_p50_s": percentile(run.ttft_s, 0.5),
            "ttft_p99_s": percentile(run.ttft_s, 0.99), "num_waited": sum(q > WAITED_S for q in queue),
            "queue_mean_s": sum(queue) / len(queue) if queue else None, "queue_p99_s": percentile(queue, 0.99),
            "preemptions": run.num_preemptions, "preemptions_by_cause": run.preemptions_by_cause,
            "recomputed_tokens": run.num_recomputed_tokens, "swapped_bytes": run.swapped_bytes,
            "latency_mean_by_class_s": {name: sum(v) / len(v) if v else None for name, v in by_class.items()},
            "outputs_exact": run.outputs_ok, "probe_reads": run.num_probe_reads, "step_ms": step_ms(run)}


def median_and_spread(values: list[float]) -> tuple[float, float]:
    """The median of a round's values and their spread, (max - min) / median (0 for one round)."""
    median = statistics.median(values)
    return median, (max(values) - min(values)) / median if median else 0.0


def round_ratios(fcfs: dict, ours: dict, oracle: dict | None) -> dict:
    """One round's ratios of `ours` to FCFS paging, and the share of the oracle's mean-latency gain it reached."""
    ratios = {name: ours[key] / fcfs[key] for name, key in (
        ("latency_mean_vs_fcfs", "latency_mean_s"), ("latency_p99_vs_fcfs", "latency_p99_s"),
        ("ttft_p50_vs_fcfs", "ttft_p50_s"), ("ttft_p99_vs_fcfs", "ttft_p99_s"),
        ("tokens_per_s_vs_fcfs", "tokens_per_s"))}
    short = "short"
    ratios["short_latency_mean_vs_fcfs"] = (ours["latency_mean_by_class_s"][short]
                                            / fcfs["latency_mean_by_class_s"][short])
    gauged = fcfs.get("step_ms") and ours.get("step_ms")
    ratios["step_ms_vs_fcfs"] = ours["step_ms"] / fcfs["step_ms"] if gauged else None
    if oracle is not None:
        gain = fcfs["latency_mean_s"] - oracle["latency_mean_s"]
        ratios["oracle_share"] = (fcfs["latency_mean_s"] - ours["latency_mean_s"]) / gain if gain > 0 else None
    return ratios


def medians_of(config, runs: list[dict]) -> dict:
    """setting -> point -> policy -> {metric: (median, spread)} over the rounds of `config` (a
    `LatencyBenchConfig`: its settings, points and policies)."""
    keys = ("latency_mean_s", "latency_p50_s", "latency_p99_s", "ttft_p50_s", "ttft_p99_s", "num_waited",
            "queue_mean_s", "queue_p99_s", "tokens_per_s", "preemptions", "recomputed_tokens")
    medians: dict = {}
    for setting in config.settings:
        for point in config.points:
            for name in config.policies:
                mine = [r for r in runs if (r["setting"], r["point"], r["policy"]) == (setting, point, name)]
                values = {key: median_and_spread([r[key] or 0.0 for r in mine]) for key in keys}
                gauged = [r["step_ms"] for r in mine if r["step_ms"] is not None]  # none: no step of that size
                values["step_ms"] = median_and_spread(gauged) if gauged else (None, 0.0)
                for cause in ("kv", "priority", "shorter_work"):
                    values[f"preemptions_{cause}"] = median_and_spread(
                        [r["preemptions_by_cause"].get(cause, 0) for r in mine])
                for cls in LENGTH_CLASSES:
                    values[f"latency_mean_{cls}_s"] = median_and_spread(
                        [r["latency_mean_by_class_s"][cls] or 0.0 for r in mine])
                medians.setdefault(setting, {}).setdefault(point, {})[name] = values
    return medians


def ratios_of(config, runs: list[dict], ours: str) -> dict:
    """setting -> point -> ratio name -> {"median", "min", "max"} over `config`'s rounds, for policy `ours` against
    fcfs."""
    ratios: dict = {}
    for setting in config.settings:
        for point in config.points:
            per_round = []
            for round_index in range(1, config.rounds + 1):
                found = {r["policy"]: r for r in runs
                         if (r["round"], r["setting"], r["point"]) == (round_index, setting, point)}
                per_round.append(round_ratios(found["fcfs"], found[ours], found.get("oracle")))
            summary = {}
            for name in per_round[0]:
                values = [r[name] for r in per_round if r[name] is not None]
                if values:
                    summary[name] = {"median": median_and_spread(values)[0], "min": min(values), "max": max(values)}
            ratios.setdefault(setting, {})[point] = summary
    return ratios
