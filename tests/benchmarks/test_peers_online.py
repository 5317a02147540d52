"""`s3serve bench peers --workload natural`: seeded arrivals, its errors, its ratios, and our side end to end.

As for the P8 workload, vLLM runs only where `make peers` made its environment; its side is exercised by
running the benchmark (docs/benchmarks.md, "bench peers").
"""

import json
import subprocess
import sys

import pytest

from benchmarks.peers_online import NaturalPeersConfig, _report, unit_arrivals


def _peers(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "s3serve_cli.main", "bench", "peers", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_arrivals_are_a_seeded_poisson_process_at_one_request_per_second():
    times = unit_arrivals(400, seed=0)
    assert times == unit_arrivals(400, seed=0) and times != unit_arrivals(400, seed=1)
    assert all(later > earlier for earlier, later in zip(times, times[1:])) and times[0] > 0
    assert 0.85 < times[-1] / 400 < 1.15  # mean gap ~1 s


@pytest.mark.parametrize("args, message", [
    (("--workload", "natural", "--kv-gib", "1"), "--kv-gib does not apply to --workload natural"),
    (("--rates", "0.5", "--kv-tokens", "100"), "--rates, --kv-tokens do not apply to --workload p8"),
    (("--workload", "natural", "--systems", "ours", "--rates", "0"), "--rates must be positive fractions"),
    (("--workload", "natural", "--systems", "ours", "--kv-tokens", "100"), "cannot hold one 1024-token sequence"),
    (("--workload", "natural", "--systems", "ours", "--predictor", "no/such/dir"), "neither noisy-oracle:SIGMA"),
    (("--probe", "default"), "--probe does not apply to --workload p8"),
    (("--max-len", "256"), "--max-len does not apply to --workload p8"),
    (("--workload", "natural", "--systems", "ours", "--max-len", "200"), "--max-len 200 leaves no room to answer"),
])
def test_bad_settings_are_one_line_errors(args, message):
    result = _peers(*args)
    assert result.returncode == 2, result.stderr[-2000:]
    assert message in result.stderr and "Traceback" not in result.stderr


def _row(system, policy, rate, latency_mean_s, tokens_per_s):
    return {"system": system, "policy": policy, "rate": rate, "rate_requests_per_s": None if rate == 0 else rate,
            "tokens_per_s": tokens_per_s, "latency_mean_s": latency_mean_s, "latency_p50_s": 1.0,
            "latency_p99_s": 4.0, "ttft_p50_s": 0.5, "ttft_p99_s": 1.0, "tpot_mean_s": 0.02, "preemptions": 0,
            "exact_lengths": True, "dtype": "bfloat16"}


def test_each_policy_at_each_rate_is_compared_with_vllm_at_that_rate():
    runs = [_row("vllm", "paged (vLLM)", 0.0, 9.0, 120.0), _row("vllm", "paged (vLLM)", 0.6, 2.0, 60.0),
            _row("vllm", "paged (vLLM)", 1.2, 8.0, 100.0),
            _row("ours", "paged_greedy", 0.6, 1.0, 60.0), _row("ours", "s3_peak", 0.6, 1.5, 60.0),
            _row("ours", "paged_greedy", 1.2, 2.0, 150.0), _row("ours", "s3_peak", 1.2, 4.0, 110.0)]
    result = _report(NaturalPeersConfig(rate_fractions=(0.6, 1.2), policies=("paged_greedy", "s3_peak")), runs, {},
                     1.0, None)
    ratios = result["ratios"]
    # the headline is the service's default policy's own run, not the better of ours
    assert ratios["policy"] == "s3_peak"
    assert ratios["latency_mean_vs_vllm"] == {"0.6": 0.75, "1.2": 0.5}
    assert ratios["tokens_per_s_vs_vllm"] == {"0.6": 1.0, "1.2": pytest.approx(1.1)}
    assert ratios["by_policy"]["paged_greedy"]["latency_mean_vs_vllm"] == {"0.6": 0.5, "1.2": 0.25}
    # where the probe runs, the service's default is s3_peak with it, and that row is the headline
    probed = [*runs, _row("ours", "s3_peak+probe", 0.6, 1.0, 66.0), _row("ours", "s3_peak+probe", 1.2, 2.0, 120.0)]
    ratios = _report(NaturalPeersConfig(rate_fractions=(0.6, 1.2)), probed, {}, 1.0, None)["ratios"]
    assert ratios["policy"] == "s3_peak+probe" and ratios["latency_mean_vs_vllm"] == {"0.6": 0.5, "1.2": 0.25}
    assert ratios["by_policy"]["s3_peak"]["latency_mean_vs_vllm"] == {"0.6": 0.75, "1.2": 0.5}


@pytest.mark.slow
def test_our_side_runs_every_policy_at_every_rate_on_the_same_arrivals(tmp_path, model_cache_dir, shared_data):
    out = tmp_path / "natural.json"
    # half --quick's max-len and KV (four worst-case sequences still), labelled here: CI time
    result = _peers("--workload", "natural", "--quick", "--systems", "ours", "--num-requests", "4",
                    "--rates", "2", "4", "--prompts", str(shared_data / "prompts" / "pool.jsonl"),
                    "--max-len", "256", "--kv-tokens", "1024", "--labels", str(tmp_path / "labels.jsonl"),
                    "--model-cache-dir", str(model_cache_dir), "--json", str(out), timeout=1200)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ttft_p50" in result.stdout and "tpot_mean" in result.stdout
    data = json.loads(out.read_text())
    runs = data["runs"]
    assert {(r["policy"], r["rate"]) for r in runs} == {
        (p, f) for p in ("paged_greedy", "s3_peak+probe", "s3_peak+oracle") for f in (2.0, 4.0)}  # --quick's
    # the probe re-predicts the forced answers (their lengths are the model's own): at least each prefill's sample
    assert all((r["probe_reads"] >= 4) == (r["policy"] == "s3_peak+probe") for r in runs)
    capacity = data["capacity_requests_per_s"]  # no vLLM here: our paged_greedy's offline capacity
    for run in runs:
        assert run["system"] == "ours" and run["exact_lengths"] and run["tokens_per_s"] > 0
        assert run["rate_requests_per_s"] == pytest.approx(run["rate"] * capacity)
        assert 0 < run["ttft_p50_s"] <= run["latency_p50_s"] and run["latency_mean_s"] <= run["latency_p99_s"] * 1.0001
    # the same work at every rate: forced to the model's own greedy lengths
    assert len({r["output_tokens"] for r in runs}) == 1
    assert data["ratios"]["by_policy"] == {} and data["workload"]["name"] == "natural"
