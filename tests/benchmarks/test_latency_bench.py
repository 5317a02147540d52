"""`s3serve bench latency`: its load, length classes, capacity, ratios, errors, and the bench end to end."""

import json
import statistics
import subprocess
import sys

import pytest

from benchmarks.latency_bench import LatencyBenchConfig, bursty_arrivals, policy_order
from benchmarks.latency_runs import capacity_of, length_classes, median_and_spread, round_ratios, step_ms
from benchmarks.policy_replay import PolicyRun
from workers.values.step_output import StepShape


def _latency(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "s3serve_cli.main", "bench", "latency", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_length_classes_are_thirds_of_the_true_lengths():
    lengths = {f"r{i}": n for i, n in enumerate([5, 400, 60, 12, 300, 80, 7, 512, 150])}
    classes = length_classes(lengths)
    assert [rid for rid in lengths if classes[rid] == "short"] == ["r0", "r3", "r6"]
    assert [rid for rid in lengths if classes[rid] == "long"] == ["r1", "r4", "r7"]


def test_the_bursty_point_keeps_the_traces_gaps_at_a_mean_of_one_request_per_second(shared_data):
    trace = shared_data / "traces" / "AzureLLMInferenceTrace_conv.csv"
    times = bursty_arrivals(trace, 200)
    assert len(times) == 200 and times[-1] == pytest.approx(200.0)
    assert all(later >= earlier for earlier, later in zip(times, times[1:])) and times[0] >= 0
    gaps = sorted(later - earlier for earlier, later in zip(times, times[1:]))
    assert gaps[len(gaps) // 10] < 0.3 < 3 < gaps[-1]  # bursts and lulls, unlike a steady stream


def test_every_second_round_runs_the_policies_backwards_so_a_drifting_machine_favours_no_row():
    policies = ("fcfs", "default", "oracle")
    orders = [policy_order(policies, r) for r in range(4)]
    assert orders == [policies, policies[::-1], policies, policies[::-1]]
    for name in policies:  # over each pair of rounds every row sits, on average, in the middle
        assert orders[0].index(name) + orders[1].index(name) == len(policies) - 1


def test_capacity_is_requests_per_second_until_ninety_percent_finished():
    run = PolicyRun("paged_greedy", latency_s=[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 30.0])
    assert capacity_of(run, 10) == 1.0  # 9 done at 9 s; the last, long one's drain is left out


def test_the_speed_gauge_is_the_median_step_of_a_middling_batch_and_its_ratio_shows_drift():
    # (shape, wall-clock s) of each step that ran; other batch sizes are not counted
    steps = [(StepShape(num_seqs, num_seqs, 100 * num_seqs, 100 * num_seqs), duration_s)
             for num_seqs, duration_s in ((2, 0.010), (4, 0.020), (8, 0.030), (12, 0.250), (30, 0.900))]
    assert step_ms(PolicyRun("fcfs", measured_steps=steps)) == pytest.approx(30.0)  # median of 20, 30 and 250 ms
    assert step_ms(PolicyRun("fcfs", measured_steps=steps[:1])) is None  # no step of 4-12 sequences
    slow, fast = {**_summary(10.0, 8.0), "step_ms": 30.0}, {**_summary(8.0, 6.0), "step_ms": 24.0}
    assert round_ratios(slow, fast, None)["step_ms_vs_fcfs"] == pytest.approx(0.8)  # the machine, not the order
    assert round_ratios(_summary(10.0, 8.0), fast, None)["step_ms_vs_fcfs"] is None


def _summary(latency_mean_s, short_s, tokens_per_s=100.0):
    return {"latency_mean_s": latency_mean_s, "latency_p99_s": 2 * latency_mean_s, "ttft_p50_s": latency_mean_s / 4,
            "ttft_p99_s": latency_mean_s, "tokens_per_s": tokens_per_s,
            "latency_mean_by_class_s": {"short": short_s, "medium": latency_mean_s, "long": 2 * latency_mean_s}}


def test_ratios_are_against_fcfs_and_the_oracle_share_is_of_its_gain():
    ratios = round_ratios(_summary(10.0, 8.0), _summary(7.0, 2.0, 98.0), _summary(6.0, 1.0))
    assert ratios["latency_mean_vs_fcfs"] == pytest.approx(0.7) and ratios["ttft_p50_vs_fcfs"] == pytest.approx(0.7)
    assert ratios["short_latency_mean_vs_fcfs"] == pytest.approx(0.25)
    assert ratios["tokens_per_s_vs_fcfs"] == pytest.approx(0.98)
    assert ratios["oracle_share"] == pytest.approx(0.75)  # 3 s of the oracle's 4 s
    assert round_ratios(_summary(10.0, 8.0), _summary(7.0, 2.0), _summary(11.0, 9.0))["oracle_share"] is None
    assert median_and_spread([2.0, 4.0, 3.0]) == (3.0, pytest.approx(2 / 3))
    assert median_and_spread([2.0, 4.0]) == (3.0, pytest.approx(2 / 3))


@pytest.mark.parametrize("changes, message", [
    ({"policies": ("default", "oracle")}, "must include fcfs"),
    ({"policies": ("fcfs", "best")}, "policies among"),
    ({"loads": (0.9, -1.0)}, "positive fractions"),
    ({"loads": (), "bursty_load": None}, "no load point"),
    ({"rounds": 0}, "rounds"),
    ({"num_requests": 2}, "num_requests"),
    ({"policies": ("fcfs", "other_probe")}, "name the probe it runs"),
    ({"other_probe": "probe_dir"}, "name the probe it runs"),
])
def test_a_config_that_cannot_run_says_why(changes, message):
    with pytest.raises(ValueError, match=message):
        LatencyBenchConfig(**changes)


def test_bad_flags_are_one_line_errors():
    result = _latency("--policies", "default", "oracle", timeout=120)
    assert result.returncode == 2 and "must include fcfs" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
def test_bench_latency_measures_capacity_then_every_round_point_and_policy(tmp_path, model_cache_dir, shared_data):
    out = tmp_path / "latency.json"
    result = _latency("--num-requests", "6", "--loads", "1.2", "--bursty-load", "0", "--settings", "kv_bound",
                      "--rounds", "2", "--max-len", "256", "--kv-bound-slots", "3", "--model-cache-dir",
                      str(model_cache_dir), "--labels", str(tmp_path / "labels.jsonl"), "--json", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["capacity"]["kv_bound"]["requests_per_s"] > 0 and data["capacity"]["kv_bound"]["kv_tokens"] == 768
    assert len(data["runs"]) == 2 * 3  # two rounds of fcfs, default and oracle
    assert {r["policy"] for r in data["runs"]} == {"fcfs", "default", "oracle"}
    assert all(r["outputs_exact"] and r["tokens_per_s"] > 0 for r in data["runs"])
    # greedy tokens agree across runs only as far as the CPU's kernels are batch-invariant; the bench says which
    tokens = data["identical_tokens"]
    assert tokens["identical"] == (not tokens["differing"]) == (tokens["num_requests_differing"] == 0)
    assert ("identical under every run" in result.stdout) == tokens["identical"]
    assert set(tokens["differing"]) <= {f"{r['round']}/kv_bound/1.2/{r['policy']}" for r in data["runs"]}
    ratios = data["ratios"]["1.2"]
    for name, key in (("latency_mean_vs_fcfs", "latency_mean_s"), ("ttft_p50_vs_fcfs", "ttft_p50_s"),
                      ("latency_p99_vs_fcfs", "latency_p99_s"), ("tokens_per_s_vs_fcfs", "tokens_per_s")):
        by_round = {(r["round"], r["policy"]): r[key] for r in data["runs"]}
        per_round = sorted(by_round[(i, "default")] / by_round[(i, "fcfs")] for i in (1, 2))  # within each round
        assert ratios[name] == pytest.approx({"median": statistics.median(per_round), "min": per_round[0],
                                              "max": per_round[1]})
    assert all(r["probe_reads"] > 0 for r in data["runs"] if r["policy"] == "default")  # the service's probe ran
    assert data["medians"]["kv_bound"]["1.2"]["default"]["latency_mean_s"][0] > 0
    assert "against fcfs paging" in result.stdout and "kv_bound (768 KV tokens" in result.stdout
