"""How good a length predictor is: ranking, buckets, error and reservation cost.

Pure numpy, so the benchmark and the retraining loop score predictors the same way.
The S3 targets (DESIGN.md, P6) are Kendall tau >= 0.5, 10-bucket accuracy >= 70% and
an under-reservation rate <= 10% on unseen prompts.
"""

from collections.abc import Sequence

import numpy as np

from predictor_service.length_predictor import LengthPrediction, bucket_edges

# Rows of the pairwise sign matrix computed at once: bounds kendall_tau's memory to
# about _TAU_CHUNK_ROWS * n int8 values per side.
_TAU_CHUNK_ROWS = 512


def _as_1d(values, name: str) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64)
    if array.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {array.shape}")
    return array


def _check_same_length(first: np.ndarray, second: np.ndarray) -> None:
    if len(first) != len(second):
        raise ValueError(f"got {len(first)} predictions for {len(second)} true lengths")
    if len(first) == 0:
        raise ValueError("no predictions to score")


def kendall_tau(predicted, true) -> float:
    """Kendall's tau-b between two orderings, ties counted as in scipy.stats.kendalltau.

    tau_b = (concordant - discordant) / sqrt((pairs - ties_in_predicted) * (pairs - ties_in_true)).
    O(n^2) in chunks of rows, which is fast enough for the few thousand held-out prompts
    we score.

    Args:
        predicted: predicted lengths (any ordering score).
        true: true lengths, same count.

    Returns:
        tau-b in [-1, 1]; 0.0 when either side is constant (no ordering to compare),
        where scipy would return NaN, so that reports stay valid JSON.
    """
    x = _as_1d(predicted, "predicted")
    y = _as_1d(true, "true")
    _check_same_length(x, y)
    concordant_minus_discordant = 0
    untied_x_pairs = 0
    untied_y_pairs = 0
    for start in range(0, len(x), _TAU_CHUNK_ROWS):
        stop = start + _TAU_CHUNK_ROWS
        sign_x = np.sign(x[start:stop, None] - x[None, :]).astype(np.int8)  # [rows, n]
        sign_y = np.sign(y[start:stop, None] - y[None, :]).astype(np.int8)  # [rows, n]
        concordant_minus_discordant += int(np.sum(sign_x.astype(np.int64) * sign_y))
        untied_x_pairs += int(np.count_nonzero(sign_x))
        untied_y_pairs += int(np.count_nonzero(sign_y))
    # Every unordered pair was counted twice (i, j) and (j, i); the factor cancels.
    denominator = np.sqrt(float(untied_x_pairs) * float(untied_y_pairs))
    if denominator == 0.0:
        return 0.0
    return float(concordant_minus_discordant / denominator)


def bucket_of(lengths, max_len: int, num_buckets: int = 10) -> np.ndarray:
    """Bucket index of each length: bucket i holds (edge[i-1], edge[i]]; longer lengths go to the last."""
    if max_len < num_buckets:
        raise ValueError(f"max_len={max_len} must be at least num_buckets={num_buckets}")
    edges = np.asarray(bucket_edges(max_len, num_buckets))
    indices = np.searchsorted(edges, _as_1d(lengths, "lengths"), side="left")
    return np.minimum(indices, num_buckets - 1)


def bucket_accuracy(predicted_buckets, true_lengths, max_len: int, num_buckets: int = 10) -> float:
    """Fraction of predicted bucket indices equal to the bucket of the true length."""
    predicted = np.asarray(predicted_buckets)
    true = _as_1d(true_lengths, "true_lengths")
    _check_same_length(predicted, true)
    return float(np.mean(predicted == bucket_of(true, max_len, num_buckets)))


def mae_tokens(predicted, true) -> float:
    """Mean absolute error of the point estimate, in tokens."""
    x = _as_1d(predicted, "predicted")
    y = _as_1d(true, "true")
    _check_same_length(x, y)
    return float(np.mean(np.abs(x - y)))


def under_reservation_rate(upper_bounds, true) -> float:
    """Fraction of requests whose true length exceeds the reserved upper bound (they overrun)."""
    upper = _as_1d(upper_bounds, "upper_bounds")
    y = _as_1d(true, "true")
    _check_same_length(upper, y)
    return float(np.mean(y > upper))


def mean_over_reservation_tokens(upper_bounds, true) -> float:
    """Mean KV tokens reserved but never used: mean of max(0, upper - true)."""
    upper = _as_1d(upper_bounds, "upper_bounds")
    y = _as_1d(true, "true")
    _check_same_length(upper, y)
    return float(np.mean(np.maximum(0.0, upper - y)))


def evaluate(predictions: Sequence[LengthPrediction], true_lengths, max_len: int) -> dict[str, float | int]:
    """Every metric of a batch of predictions against the true output lengths.

    The predicted bucket is the argmax of `bucket_probs` (the classifier's answer),
    so bucket accuracy scores the probabilities, not the point estimate.

    Returns:
        {"kendall_tau", "bucket_accuracy", "mae_tokens", "under_reservation_rate",
        "mean_over_reservation_tokens", "num_examples"}.
    """
    true = _as_1d(true_lengths, "true_lengths")
    if len(predictions) != len(true):
        raise ValueError(f"got {len(predictions)} predictions for {len(true)} true lengths")
    points = [prediction.point_tokens for prediction in predictions]
    uppers = [prediction.upper_bound_tokens for prediction in predictions]
    num_buckets = len(predictions[0].bucket_probs) if predictions else 10
    buckets = [int(np.argmax(prediction.bucket_probs)) for prediction in predictions]
    return {
        "kendall_tau": kendall_tau(points, true),
        "bucket_accuracy": bucket_accuracy(buckets, true, max_len, num_buckets),
        "mae_tokens": mae_tokens(points, true),
        "under_reservation_rate": under_reservation_rate(uppers, true),
        "mean_over_reservation_tokens": mean_over_reservation_tokens(uppers, true),
        "num_examples": len(true),
    }


def distribution_metrics(predictions: Sequence[LengthPrediction], true_lengths, prompt_ids: Sequence[str],
                         max_len: int) -> dict[str, float | int]:
    """How well predictions describe each prompt's length distribution, given several samples per prompt.

    One draw is a noisy target when sampling: these scores compare with the distribution
    instead. The point is scored against each prompt's median sample, the ordering against
    the prompts' medians, and the bucket probabilities by the mean negative log-likelihood
    of every sample's bucket under its row's probabilities (a proper score: lowest when
    they are the prompt's own bucket frequencies). A prompt's point is that of its first
    row (a predictor that reads the prompt gives all its rows the same).

    Returns:
        {"kendall_tau_vs_median", "median_mae_tokens", "bucket_nll", "num_prompts"}.
    """
    true = _as_1d(true_lengths, "true_lengths")
    if not len(predictions) == len(true) == len(prompt_ids):
        raise ValueError(f"got {len(predictions)} predictions and {len(prompt_ids)} prompt ids for "
                         f"{len(true)} true lengths")
    if len(true) == 0:
        raise ValueError("no predictions to score")
    rows_of: dict[str, list[int]] = {}
    for index, prompt_id in enumerate(prompt_ids):
        rows_of.setdefault(prompt_id, []).append(index)
    points = [predictions[rows[0]].point_tokens for rows in rows_of.values()]
    medians = [float(np.median(true[rows])) for rows in rows_of.values()]
    num_buckets = len(predictions[0].bucket_probs)
    buckets = bucket_of(true, max_len, num_buckets)  # [rows]
    probs = np.asarray([prediction.bucket_probs for prediction in predictions], dtype=np.float64)  # [rows, buckets]
    sample_probs = np.clip(probs[np.arange(len(true)), buckets], 1e-6, 1.0)
    return {
        "kendall_tau_vs_median": kendall_tau(points, medians),
        "median_mae_tokens": mae_tokens(points, medians),
        "bucket_nll": float(np.mean(-np.log(sample_probs))),
        "num_prompts": len(rows_of),
    }
