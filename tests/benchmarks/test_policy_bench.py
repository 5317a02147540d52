"""`s3serve bench policies` end to end on the real model, small enough for CI."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from workers.engine.linear_weights import reads_bf16_weights
from workers.engine.models import DEFAULT_MODEL

pytestmark = pytest.mark.slow


def test_bench_policies_writes_every_metric_ratio_and_plot(tmp_path, model_cache_dir, shared_data):
    out_json, plot_dir = tmp_path / "out.json", tmp_path / "plots"
    result = subprocess.run(
        [sys.executable, "-m", "s3serve_cli.main", "bench", "policies",
         "--trace", str(shared_data / "traces" / "AzureLLMInferenceTrace_conv.csv"),
         "--prompts", str(shared_data / "prompts" / "pool.jsonl"),
         "--num-requests", "6", "--max-len", "256", "--max-prompt-tokens", "32",
         "--sweep-sigma", "1.5", "--model-cache-dir", str(model_cache_dir),
         "--json", str(out_json), "--plot", str(plot_dir)],
        capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "prompts capped at 32 tokens" in result.stdout
    data = json.loads(out_json.read_text())
    # the weights the service serves on this CPU: bf16 linear weights under fp32 where dtype auto reads them so
    assert data["precision"] == ("fp32+bf16w" if reads_bf16_weights("auto", "cpu") else "fp32")
    assert f"model {DEFAULT_MODEL}: {data['precision']}" in result.stdout
    assert set(data["policies"]) == {"max_reserve", "paged_greedy", "s3", "s3_peak", "sglang_ratio", "oracle"}
    for name, metrics in data["policies"].items():
        for key in ("tokens_per_s", "mean_concurrency", "recomputed_tokens", "latency_p99_s", "ttft_p99_s",
                    "tpot_p50_s", "kv_used_fraction_mean", "kv_reserved_fraction_mean", "swapped_bytes"):
            assert key in metrics, (name, key)
        assert metrics["all_outputs_exact_length"], name
        assert 0 < metrics["kv_used_fraction_mean"] <= metrics["kv_reserved_fraction_mean"] <= 1.0
    assert data["policies"]["max_reserve"]["max_concurrency"] <= data["max_reserve_slots"]
    assert data["policies"]["max_reserve"]["preemptions"] == 0
    assert data["policies"]["oracle"]["preemptions"] == 0
    for key in ("s3_vs_max_reserve", "s3_vs_paged_greedy", "s3_vs_sglang_ratio", "s3_vs_oracle"):
        assert data["ratios"][key] > 0
    assert [s["predictor"] for s in data["sigma_sweep"]] == ["noisy-oracle:1.5", "noisy-oracle:1.5"]
    assert sorted(p.name for p in plot_dir.iterdir()) == ["concurrency.png", "kv_utilisation.png", "throughput.png"]
    assert all(metrics["step_ms_by_batch"] for metrics in data["policies"].values())


def test_bench_policies_on_a_random_model_of_a_named_shape(tmp_path, model_cache_dir, shared_data):
    """--model-shape: weights do not matter when lengths are forced; the shape sets the KV budget and step times."""
    out_json = tmp_path / "out.json"
    result = subprocess.run(
        [sys.executable, "-m", "s3serve_cli.main", "bench", "policies", "--model-shape", "tiny",
         "--policies", "max_reserve", "s3", "--trace", str(shared_data / "traces" / "AzureLLMInferenceTrace_conv.csv"),
         "--prompts", str(shared_data / "prompts" / "pool.jsonl"), "--num-requests", "8", "--max-len", "256",
         "--max-prompt-tokens", "32", "--model-cache-dir", str(model_cache_dir), "--json", str(out_json)],
        capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "model shape tiny" in result.stdout and "step ms by sequences in the step" in result.stdout
    data = json.loads(out_json.read_text())
    assert data["model"] == "random tiny shape" and data["device"] == "cpu"
    # The tiny shape's KV per token (2 layers x 2 KV heads x 16 x K and V, fp32) sizes the budget: 4 worst cases.
    assert data["kv_cache_bytes"] == 4 * 256 * (2 * 2 * 2 * 16 * 4)
    assert data["max_reserve_slots"] == 4
    assert all(m["all_outputs_exact_length"] for m in data["policies"].values())
    assert data["policies"]["max_reserve"]["max_concurrency"] <= 4 < data["policies"]["s3"]["max_concurrency"]
    assert data["ratios"]["s3_vs_max_reserve"] > 0


def test_bench_policies_rejects_an_unknown_predictor_in_one_line(tmp_path, model_cache_dir, shared_data):
    result = subprocess.run(
        [sys.executable, "-m", "s3serve_cli.main", "bench", "policies", "--num-requests", "2",
         "--trace", str(shared_data / "traces" / "AzureLLMInferenceTrace_conv.csv"),
         "--prompts", str(shared_data / "prompts" / "pool.jsonl"),
         "--predictor", "noisy-oracle:abc", "--model-cache-dir", str(model_cache_dir)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 2
    assert "noisy-oracle:abc" in result.stderr and "SIGMA must be a number" in result.stderr


def test_bench_policies_runs_with_a_trained_predictor_artifact(tmp_path, model_cache_dir, shared_data):
    from benchmarks.predictor_bench import load_prompt_texts_by_id
    from predictor_service.features import FeatureConfig
    from predictor_service.training import build_dataset, read_labels, train_predictor

    shipped = (Path(__file__).resolve().parents[2] / "predictor_service" / "labels"
               / "smollm2-135m-instruct.pool.greedy.jsonl")
    labels = read_labels([shipped])[:120]
    dataset = build_dataset(labels, load_prompt_texts_by_id([shared_data / "prompts" / "pool.jsonl"]))
    train_predictor(dataset, "lightgbm", feature_config=FeatureConfig(num_hash_dims=32), out_dir=tmp_path / "art")
    out_json = tmp_path / "out.json"
    result = subprocess.run(
        [sys.executable, "-m", "s3serve_cli.main", "bench", "policies",
         "--trace", str(shared_data / "traces" / "AzureLLMInferenceTrace_conv.csv"),
         "--prompts", str(shared_data / "prompts" / "pool.jsonl"),
         "--num-requests", "4", "--max-len", "256", "--max-prompt-tokens", "32", "--policies", "s3", "oracle",
         "--predictor", str(tmp_path / "art"), "--model-cache-dir", str(model_cache_dir), "--json", str(out_json)],
        capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(out_json.read_text())
    assert data["predictor"] == str(tmp_path / "art")
    assert set(data["policies"]) == {"s3", "oracle"}
    assert data["policies"]["s3"]["all_outputs_exact_length"]
    assert data["ratios"]["s3_vs_oracle"] > 0


def test_bench_policies_rejects_a_predictor_that_is_no_artifact(tmp_path, model_cache_dir, shared_data):
    result = subprocess.run(
        [sys.executable, "-m", "s3serve_cli.main", "bench", "policies", "--num-requests", "2",
         "--trace", str(shared_data / "traces" / "AzureLLMInferenceTrace_conv.csv"),
         "--predictor", str(tmp_path / "missing"), "--model-cache-dir", str(model_cache_dir)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 2
    assert "neither noisy-oracle:SIGMA nor a predictor artifact directory" in result.stderr


def test_step_times_are_grouped_by_sequences_in_the_step():
    from benchmarks.policy_summary import step_ms_by_batch

    steps = [(0.0, 0.010, 1, 0, 0), (0.0, 0.020, 1, 0, 0), (0.0, 0.5, 0, 0, 0),  # an idle gap: left out
             (0.0, 0.030, 5, 0, 0), (0.0, 0.050, 7, 0, 0), (0.0, 0.100, 300, 0, 0)]
    assert step_ms_by_batch(steps) == pytest.approx({"1": 15.0, "4": 40.0, "256": 100.0})
