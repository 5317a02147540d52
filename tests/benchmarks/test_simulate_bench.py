"""`s3serve bench simulate`: the table and JSON, clear errors, and the simulator against the real engine."""

import json
import subprocess
import sys

import pytest

# A broken fit (wrong units, a missing term) is off by far more than this; a machine busy with other work during one
# policy's run is off by up to ~50% (a CI run), so the accuracy itself is the bench's printed number, not a test's.
GROSS_FACTOR = 3.0


def _simulate(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "s3serve_cli.main", "bench", "simulate", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_simulate_writes_the_table_json_and_plot(tmp_path, shared_data):
    out_json, plot = tmp_path / "out.json", tmp_path / "sim.png"
    result = _simulate("--trace", str(shared_data / "traces" / "AzureLLMInferenceTrace_conv.csv"),
                       "--workers", "2", "8", "--requests-per-worker", "12", "--no-calibration",
                       "--json", str(out_json), "--plot", str(plot))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("SIMULATION")
    assert "s3_vs_max_reserve" in result.stdout
    data = json.loads(out_json.read_text())
    assert data["simulation"] is True and "not measured on a GPU" in data["statement"]
    assert {(r["policy"], r["num_workers"]) for r in data["runs"]} == {
        (p, n) for p in ("max_reserve", "paged_greedy", "s3", "s3_peak", "sglang_ratio") for n in (2, 8)}
    for run in data["runs"]:
        assert run["tokens_per_s"] > 0 and run["all_outputs_exact_length"]
        assert run["num_requests"] == 12 * run["num_workers"]
        assert run["latency_p99_s"] >= run["latency_p50_s"] > 0
    by = {(r["policy"], r["num_workers"]): r["tokens_per_s"] for r in data["runs"]}
    best = max(by[("s3", 8)], by[("s3_peak", 8)])
    assert data["ratios"]["s3_vs_max_reserve"] == pytest.approx(best / by[("max_reserve", 8)])
    assert data["ratios"]["s3_vs_sglang_ratio"] == pytest.approx(best / by[("sglang_ratio", 8)])
    assert data["ratios"]["at_num_workers"] == 8
    assert plot.stat().st_size > 10_000


def test_the_paper_workload_runs_instructions_with_their_answers_lengths(tmp_path, model_cache_dir, shared_data):
    out_json = tmp_path / "out.json"
    result = _simulate("--workload", "paper", "--answers", str(shared_data / "prompts" / "text-davinci-003_predictions.jsonl"),
                       "--workers", "2", "--requests-per-worker", "40", "--no-calibration",
                       "--model-cache-dir", str(model_cache_dir), "--json", str(out_json))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "workload: paper: 252 instructions with text-davinci-003's answers" in result.stdout
    data = json.loads(out_json.read_text())
    assert data["workload"] == "paper" and data["trace"].endswith("text-davinci-003_predictions.jsonl")
    assert {r["num_requests"] for r in data["runs"]} == {80}
    for run in data["runs"]:
        assert run["all_outputs_exact_length"]
        assert 0 < run["steady_s"] < run["makespan_s"]
        assert run["steady_tokens_per_s"] > 0
    by = {r["policy"]: r["steady_tokens_per_s"] for r in data["runs"]}
    steady = data["ratios"]["steady"]
    best = max(by["s3"], by["s3_peak"])
    assert steady["s3_vs_max_reserve"] == pytest.approx(best / by["max_reserve"])
    assert steady["best_length_aware"] == max(("s3", "s3_peak"), key=by.get)


@pytest.mark.parametrize("args, message", [
    (("--workload", "paper", "--answers", "no/such/answers.jsonl"), "answers file no/such/answers.jsonl not found"),
    (("--kind", "cpu", "--no-calibration"), "kind 'cpu' simulates with the CPU-calibrated step model"),
    (("--workers", "0"), "worker counts must be >= 1"),
    (("--calibration-device", "tpu"), "--calibration-device must be cpu or cuda[:N], got 'tpu'"),
    (("--rebalance-min-gap", "1"), "--rebalance-min-gap must be 0 (off) or at least 2"),
    (("--max-prompt-tokens", "4096"), "must be below max_len"),
    (("--kind", "l4", "--max-len", "100000", "--max-prompt-tokens", "10"), "not one 100000-token sequence"),
])
def test_bad_settings_are_one_line_errors(args, message):
    defaults = ("--workers", "1", "--requests-per-worker", "2", "--no-calibration")
    result = _simulate(*defaults, *args)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr


def test_the_calibration_cuts_its_prompts_from_the_prompts_flag(model_cache_dir):
    result = _simulate("--workers", "1", "--requests-per-worker", "2", "--model-cache-dir", str(model_cache_dir),
                       "--prompts", "no/such/pool.jsonl")
    assert result.returncode == 2
    assert "prompt file no/such/pool.jsonl does not exist" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
def test_simulator_agrees_with_the_real_engine_on_this_cpu(tmp_path, model_cache_dir, shared_data):
    """Calibrated on paged_greedy's steps, the simulator gives back its tokens/s and predicts max_reserve's and s3's."""
    out_json = tmp_path / "out.json"
    result = _simulate("--trace", str(shared_data / "traces" / "AzureLLMInferenceTrace_conv.csv"),
                       "--kind", "cpu", "--workers", "1", "4", "--requests-per-worker", "10",
                       "--calibration-requests", "10", "--model-cache-dir", str(model_cache_dir),
                       "--json", str(out_json), timeout=1200)
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(out_json.read_text())
    calibration = data["calibration"]
    assert calibration["calibrated_on"] == "paged_greedy" and calibration["fit_steps"] >= 8
    assert [row["policy"] for row in calibration["agreement"]] == ["paged_greedy", "max_reserve", "s3"]
    fitted_on, *others = calibration["agreement"]
    # the simulator replays the fitted policy's own steps, so its tokens/s come back whatever the machine's load
    assert abs(fitted_on["error_pct"]) < 1.0, fitted_on
    for row in others:
        real, simulated = row["real_tokens_per_s"], row["simulated_tokens_per_s"]
        assert real > 0 and 1 / GROSS_FACTOR < simulated / real < GROSS_FACTOR, row
        assert row["error_pct"] == pytest.approx(100.0 * (simulated - real) / real)
    assert data["kind"] == "cpu"
    assert sorted((r["policy"], r["num_workers"]) for r in data["runs"]) == sorted(
        (p, n) for p in ("max_reserve", "paged_greedy", "s3", "s3_peak", "sglang_ratio") for n in (1, 4))


def test_reused_rows_come_back_in_a_fresh_order_each_pass():
    from benchmarks.simulate_bench import build_sim_requests
    from benchmarks.traces import TraceRow

    rows = [TraceRow(0.0, 10 + i, 1 + i) for i in range(20)]
    requests = build_sim_requests(rows, 60, max_len=256, max_prompt_tokens=128, sigma=0.3, seed=0)
    passes = [[r.num_output_tokens for r in requests[k:k + 20]] for k in (0, 20, 40)]
    assert passes[0] == [1 + i for i in range(20)]  # the file's order first
    assert all(sorted(p) == passes[0] for p in passes[1:])  # every row once per pass
    assert passes[1] != passes[0] and passes[2] != passes[1]
    again = build_sim_requests(rows, 60, max_len=256, max_prompt_tokens=128, sigma=0.3, seed=0)
    assert [r.num_output_tokens for r in again] == [r.num_output_tokens for r in requests]  # seeded


def test_a_calibration_checks_the_roofline_on_the_same_measured_steps():
    """What `--calibration-device cuda` prints, run here on the CPU with a tiny model: the fitted model says where
    it was measured, and the roofline is scored on every policy's steps and tokens/s."""
    from benchmarks.sim_calibration import calibrate
    from benchmarks.sim_worker import SimRequest
    from benchmarks.step_time import RooflineStepModel, gpu_kind, shape_cost
    from workers.engine.model_runner import pool_shape_for
    from workers.engine.models import make_tiny_model

    model = make_tiny_model(seed=0)
    pool = pool_shape_for(model.config, 1, 16, model.dtype)
    kv_bytes_per_token = pool.bytes_per_block // 16
    requests = [SimRequest(f"r{i}", 0.0, 8 + 3 * i, 10 + 5 * i, 120 - 3 * i, 40) for i in range(6)]
    prompts = {r.request_id: list(range(3, 3 + r.num_prompt_tokens)) for r in requests}
    roofline = RooflineStepModel(gpu_kind("h100-sxm"), shape_cost("tiny"))
    calibration = calibrate(model, requests, prompts, ("paged_greedy", "max_reserve"), 128, 16 * 16 * kv_bytes_per_token,
                            16, 16, 8, 64, kv_bytes_per_token, roofline=roofline, measured_on="the test engine")
    assert calibration.model.describe().startswith("calibrated on the test engine:")
    assert [row[0] for row in calibration.roofline_agreement] == ["paged_greedy", "max_reserve"]
    assert calibration.roofline_fit.num_steps > calibration.fit.num_steps  # both policies' steps
    for (policy, real, simulated, error), fitted_row in zip(calibration.roofline_agreement, calibration.agreement):
        assert real == fitted_row[1] > 0 and simulated > 0
        assert error == pytest.approx(100.0 * (simulated - real) / real)
