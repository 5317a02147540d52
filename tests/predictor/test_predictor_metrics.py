"""Predictor metrics on hand-computed cases."""

import numpy as np
import pytest

from predictor_service.length_predictor import LengthPrediction
from predictor_service.metrics import (
    bucket_accuracy,
    bucket_of,
    evaluate,
    kendall_tau,
    mae_tokens,
    mean_over_reservation_tokens,
    under_reservation_rate,
)


def test_kendall_tau_perfect_reversed_and_partial_orderings():
    assert kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert kendall_tau([1, 2, 3, 4], [40, 30, 20, 10]) == pytest.approx(-1.0)
    # Pairs (1,2) and (3,4) discordant, the other four concordant: (4 - 2) / 6.
    assert kendall_tau([1, 2, 3, 4], [2, 1, 4, 3]) == pytest.approx(1 / 3)


def test_kendall_tau_b_discounts_ties_on_each_side():
    # 6 pairs: 4 concordant, one tied only in x, one tied only in y: 4 / sqrt(5 * 5).
    assert kendall_tau([1, 2, 2, 3], [1, 2, 3, 3]) == pytest.approx(0.8)
    # A pair tied on both sides leaves both denominators: 5 pairs, 4 concordant, 1 untied in y only.
    assert kendall_tau([1, 1, 2, 3], [1, 2, 3, 4]) == pytest.approx(5 / np.sqrt(5 * 6))


def test_kendall_tau_is_zero_for_a_constant_side_and_chunking_does_not_change_it():
    assert kendall_tau([7, 7, 7], [1, 2, 3]) == 0.0
    rng = np.random.default_rng(0)
    x = rng.integers(0, 50, 1300)
    y = x + rng.integers(0, 30, 1300)
    tau_chunked = kendall_tau(x, y)
    sign = np.sign(x[:, None] - x[None, :]) * np.sign(y[:, None] - y[None, :])
    untied_pairs = np.count_nonzero(x[:, None] - x[None, :]) * np.count_nonzero(y[:, None] - y[None, :])
    expected = sign.sum() / np.sqrt(untied_pairs)
    assert tau_chunked == pytest.approx(expected)


def test_metrics_reject_mismatched_or_empty_inputs():
    with pytest.raises(ValueError, match="2 predictions for 3"):
        kendall_tau([1, 2], [1, 2, 3])
    with pytest.raises(ValueError, match="no predictions"):
        mae_tokens([], [])


def test_buckets_are_right_closed_and_overflow_goes_to_the_last():
    # max_len 100: edges 10, 20, ..., 100.
    assert bucket_of([0, 10, 11, 100, 150], 100).tolist() == [0, 0, 1, 9, 9]
    assert bucket_accuracy([0, 1, 9, 3], [5, 15, 99, 5], 100) == pytest.approx(0.75)


def test_error_and_reservation_metrics():
    true = [10, 20, 30, 40]
    assert mae_tokens([12, 20, 25, 40], true) == pytest.approx((2 + 0 + 5 + 0) / 4)
    upper = [15, 19, 30, 100]
    assert under_reservation_rate(upper, true) == pytest.approx(0.25)
    assert mean_over_reservation_tokens(upper, true) == pytest.approx((5 + 0 + 0 + 60) / 4)


def test_evaluate_scores_points_bounds_and_bucket_argmax():
    one_hot = [tuple(1.0 if i == j else 0.0 for i in range(10)) for j in range(10)]
    predictions = [
        LengthPrediction(10, 20, one_hot[0]),
        LengthPrediction(30, 35, one_hot[2]),
        LengthPrediction(50, 60, one_hot[5]),
    ]
    metrics = evaluate(predictions, [8, 40, 55], max_len=100)
    assert metrics == {
        "kendall_tau": pytest.approx(1.0),
        "bucket_accuracy": pytest.approx(2 / 3),  # 40 is in bucket 3, not 2
        "mae_tokens": pytest.approx((2 + 10 + 5) / 3),
        "under_reservation_rate": pytest.approx(1 / 3),
        "mean_over_reservation_tokens": pytest.approx((12 + 0 + 5) / 3),
        "num_examples": 3,
    }


def test_distribution_metrics_score_each_prompt_against_all_its_samples():
    from predictor_service.metrics import distribution_metrics

    def freqs(**mass):  # bucket probabilities from {"b<i>": p}
        return tuple(mass.get(f"b{i}", 0.0) for i in range(10))

    samples = {"a": [25, 28, 30, 5], "b": [60, 62, 70, 64]}  # max_len 100: buckets of width 10, right-closed
    own = {"a": freqs(b0=0.25, b2=0.75), "b": freqs(b5=0.25, b6=0.75)}  # each prompt's own bucket frequencies
    ids = [p for p, lengths in samples.items() for _ in lengths]
    true = [length for lengths in samples.values() for length in lengths]
    matched = distribution_metrics([LengthPrediction(26, 40, own["a"])] * 4 + [LengthPrediction(63, 80, own["b"])] * 4,
                                   true, ids, max_len=100)
    assert matched["median_mae_tokens"] == pytest.approx((0.5 + 0.0) / 2)  # medians are 26.5 and 63
    assert matched["kendall_tau_vs_median"] == pytest.approx(1.0)
    assert matched["num_prompts"] == 2
    assert matched["bucket_nll"] == pytest.approx(-(0.25 * np.log(0.25) + 0.75 * np.log(0.75)))
    swapped = distribution_metrics([LengthPrediction(63, 80, own["b"])] * 4 + [LengthPrediction(26, 40, own["a"])] * 4,
                                   true, ids, max_len=100)
    assert swapped["kendall_tau_vs_median"] == pytest.approx(-1.0)
    sure = freqs(b2=0.5, b6=0.5)  # right buckets but not the prompt's proportions
    hedged = distribution_metrics([LengthPrediction(26, 40, sure)] * 4 + [LengthPrediction(63, 80, sure)] * 4,
                                  true, ids, max_len=100)
    assert matched["bucket_nll"] < hedged["bucket_nll"] < swapped["bucket_nll"]  # a miss costs -log(1e-6)
    with pytest.raises(ValueError, match="prompt ids"):
        distribution_metrics([LengthPrediction(1, 2, sure)] * 8, true, ids[:-1], max_len=100)
