"""Conformal calibration of the upper bound: the offset's arithmetic, and coverage on unseen prompts."""

import json
from pathlib import Path

import numpy as np
import pytest

from predictor_service.artifacts import load_predictor, save_predictor
from predictor_service.calibration import BoundCalibration, conformal_log_offset, fit_calibration
from predictor_service.features import FeatureConfig
from predictor_service.length_example import LengthExample
from predictor_service.lightgbm_predictor import BoosterConfig, LightGBMLengthPredictor
from predictor_service.metrics import evaluate
from predictor_service.training import LengthDataset, split_by_prompt_id

WORDS = ("write", "list", "explain", "name", "story", "poem", "answer", "short", "long", "code")


def test_offset_is_the_conformal_rank_of_log_residuals():
    raw = np.full(9, 99.0)  # log1p(raw) = log(100)
    true = np.array([9, 19, 29, 39, 49, 59, 69, 79, 89], dtype=float)
    # ceil((9 + 1) * 0.8) = 8th smallest residual: log(80) - log(100)
    assert conformal_log_offset(raw, true, 0.8) == pytest.approx(np.log(0.8))
    # rank beyond n takes the largest residual
    assert conformal_log_offset(raw, true, 0.95) == pytest.approx(np.log(0.9))
    with pytest.raises(ValueError, match="equal non-empty"):
        conformal_log_offset([1.0], [1.0, 2.0], 0.9)


def test_calibration_scales_bounds_and_needs_enough_examples():
    calibration = fit_calibration(np.full(20, 99.0), np.full(20, 199.0), 0.9, "split-conformal")
    assert calibration.raw_coverage == 0.0
    assert calibration.apply([99.0, 49.0]) == pytest.approx([199.0, 99.0])  # x2 on (1 + length)
    assert BoundCalibration.from_dict(calibration.to_dict()) == calibration
    assert fit_calibration(np.ones(5), np.ones(5), 0.9, "split-conformal") is None


def noisy_dataset(num: int, seed: int = 0) -> LengthDataset:
    """Length grows with one keyword's count, times heavy log-normal noise the features cannot see."""
    rng = np.random.default_rng(seed)
    examples, lengths = [], []
    for index in range(num):
        words = rng.choice(WORDS, size=12)
        base = 20 + 60 * int(np.sum(words == "long"))
        examples.append(LengthExample(f"syn:{index}", " ".join(words), 30, 1000))
        lengths.append(int(min(1000, max(1, base * rng.lognormal(0.0, 0.8)))))
    return LengthDataset(examples, lengths)


def test_lightgbm_bound_covers_unseen_prompts_near_the_quantile_and_survives_an_artifact(tmp_path: Path):
    train, held_out = split_by_prompt_id(noisy_dataset(1500), 0.4)
    # Deep trees on small leaves overfit the quantile: its raw bound undercovers on new prompts.
    predictor = LightGBMLengthPredictor(FeatureConfig(num_hash_dims=32), 0.9, 1024,
                                        BoosterConfig(num_rounds=120, num_bucket_rounds=5, min_data_in_leaf=3,
                                                      num_leaves=31)).fit(train.examples, train.lengths)
    calibrated = evaluate(predictor.predict_examples(held_out.examples), held_out.lengths, 1024)
    calibration, predictor.calibration = predictor.calibration, None
    raw = evaluate(predictor.predict_examples(held_out.examples), held_out.lengths, 1024)
    predictor.calibration = calibration
    assert calibration.method == "cross-conformal-5" and calibration.num_calibration == len(train.examples)
    assert raw["under_reservation_rate"] > 0.15
    assert 0.04 <= calibrated["under_reservation_rate"] <= 0.15
    assert calibrated["mean_over_reservation_tokens"] > raw["mean_over_reservation_tokens"]

    directory = save_predictor(predictor, tmp_path, calibrated, {"quantile": 0.9})
    assert json.loads((directory / "calibration.json").read_text())["conformal"] == calibration.to_dict()
    loaded = load_predictor(tmp_path)
    assert loaded.calibration == calibration
    assert loaded.predict_examples(held_out.examples[:40]) == predictor.predict_examples(held_out.examples[:40])
