"""Two baselines a learned predictor must beat, the training mean and a line in prompt length, and the prior a
service starts from for a model nobody has labelled (it knows only each request's max_tokens)."""

from collections.abc import Sequence

import numpy as np

from predictor_service.calibration import fit_calibration, fold_of
from predictor_service.length_example import FittedLengthPredictor, LengthExample, check_training_set, clamp_tokens
from predictor_service.length_predictor import DEFAULT_MAX_LEN, DEFAULT_QUANTILE, LengthPrediction, bucket_edges

# The residual distribution is kept as this many evenly spaced quantiles: enough for
# 10 bucket probabilities, small enough to store in JSON and to add to every prediction.
NUM_RESIDUAL_QUANTILES = 100


def check_quantile(quantile: float) -> None:
    if not 0.0 < quantile < 1.0:
        raise ValueError(f"quantile must be in (0, 1), got {quantile}")


def bucket_histogram(lengths: np.ndarray, max_len: int, num_buckets: int = 10) -> np.ndarray:
    """Probability of each equal-width bucket under the empirical distribution of `lengths`.

    lengths: [..., m] samples; returns [..., num_buckets], summing to 1 over the last axis.
    """
    edges = np.asarray(bucket_edges(max_len, num_buckets))
    indices = np.minimum(np.searchsorted(edges, lengths, side="left"), num_buckets - 1)  # [..., m]
    one_hot = indices[..., None] == np.arange(num_buckets)  # [..., m, num_buckets]
    return one_hot.mean(axis=-2)


def _prediction(point: int, upper: int, probs: np.ndarray) -> LengthPrediction:
    return LengthPrediction(int(point), int(max(upper, point)), tuple(float(p) for p in probs))


class MeanLengthPredictor(FittedLengthPredictor):
    """Predicts the training mean for every prompt; reserves the training quantile.

    Bucket probabilities are the training lengths' histogram, so the argmax is the
    most common bucket.

    Args:
        quantile: probability that the true length stays within the upper bound.
        max_len: longest sequence; the buckets span [0, max_len].
    """

    name = "mean"

    def __init__(self, quantile: float = DEFAULT_QUANTILE, max_len: int = DEFAULT_MAX_LEN) -> None:
        super().__init__()
        check_quantile(quantile)
        self.quantile = quantile
        self.max_len = max_len
        self.mean_tokens: float | None = None
        self.upper_tokens: float | None = None
        self.bucket_probs: np.ndarray | None = None

    def fit(self, examples: Sequence[LengthExample], lengths: Sequence[int]) -> "MeanLengthPredictor":
        array = check_training_set(examples, lengths)
        self.mean_tokens = float(array.mean())
        self.upper_tokens = float(np.quantile(array, self.quantile))
        self.bucket_probs = bucket_histogram(array, self.max_len)
        return self

    def predict_examples(self, examples: Sequence[LengthExample]) -> list[LengthPrediction]:
        if self.mean_tokens is None:
            raise ValueError("MeanLengthPredictor is not fitted: call fit() or load an artifact")
        max_tokens = np.array([example.max_tokens for example in examples])
        points = clamp_tokens(np.full(len(examples), self.mean_tokens), max_tokens)
        uppers = clamp_tokens(np.full(len(examples), self.upper_tokens), max_tokens)
        return [_prediction(p, u, self.bucket_probs) for p, u in zip(points, uppers)]

    def to_params(self) -> dict:
        return {"quantile": self.quantile, "max_len": self.max_len, "mean_tokens": self.mean_tokens,
                "upper_tokens": self.upper_tokens, "bucket_probs": self.bucket_probs.tolist()}

    @classmethod
    def from_params(cls, params: dict) -> "MeanLengthPredictor":
        predictor = cls(params["quantile"], params["max_len"])
        predictor.mean_tokens = float(params["mean_tokens"])
        predictor.upper_tokens = float(params["upper_tokens"])
        predictor.bucket_probs = np.asarray(params["bucket_probs"], dtype=np.float64)
        return predictor


class PromptLengthLinearPredictor(FittedLengthPredictor):
    """Least squares of output length on prompt token count.

    The upper bound is the prediction plus the training residuals' quantile, then
    calibrated conformally on out-of-fold fits (calibration.py); bucket probabilities
    come from the prediction shifted by the residual distribution.

    Args:
        quantile: probability that the true length stays within the upper bound.
        max_len: longest sequence; the buckets span [0, max_len].
        num_calibration_folds: folds of the cross-conformal calibration; 0 keeps the raw bound.
    """

    name = "linear"

    def __init__(self, quantile: float = DEFAULT_QUANTILE, max_len: int = DEFAULT_MAX_LEN, num_calibration_folds: int = 5) -> None:
        super().__init__()
        check_quantile(quantile)
        self.quantile = quantile
        self.max_len = max_len
        self.num_calibration_folds = num_calibration_folds
        self.intercept_tokens: float | None = None
        self.tokens_per_prompt_token: float | None = None
        self.residual_upper_tokens: float | None = None
        self.residual_quantiles: np.ndarray | None = None

    def _design(self, examples: Sequence[LengthExample]) -> np.ndarray:
        prompt_tokens = np.array([example.num_prompt_tokens for example in examples], dtype=np.float64)
        return np.stack([np.ones_like(prompt_tokens), prompt_tokens], axis=1)  # [n, 2]

    def fit(self, examples: Sequence[LengthExample], lengths: Sequence[int]) -> "PromptLengthLinearPredictor":
        array = check_training_set(examples, lengths)
        design = self._design(examples)
        coefficients, *_ = np.linalg.lstsq(design, array, rcond=None)
        self.intercept_tokens, self.tokens_per_prompt_token = (float(c) for c in coefficients)
        residuals = array - design @ coefficients
        self.residual_upper_tokens = float(np.quantile(residuals, self.quantile))
        levels = (np.arange(NUM_RESIDUAL_QUANTILES) + 0.5) / NUM_RESIDUAL_QUANTILES
        self.residual_quantiles = np.quantile(residuals, levels)
        self.calibration = self._cross_conformal(examples, design, array)
        return self

    def _cross_conformal(self, examples: Sequence[LengthExample], design: np.ndarray, lengths: np.ndarray):
        """Calibration from out-of-fold line + residual-quantile bounds; None when folds are off or too small."""
        if self.num_calibration_folds < 2:
            return None
        folds = np.array([fold_of(example.prompt_id, self.num_calibration_folds) for example in examples])
        if len(set(folds.tolist())) < 2:
            return None
        raw_uppers = np.zeros(len(examples))
        for fold in np.unique(folds):
            held = folds == fold
            coefficients, *_ = np.linalg.lstsq(design[~held], lengths[~held], rcond=None)
            residual_upper = np.quantile(lengths[~held] - design[~held] @ coefficients, self.quantile)
            raw_uppers[held] = design[held] @ coefficients + residual_upper
        max_tokens = np.array([example.max_tokens for example in examples])
        return fit_calibration(clamp_tokens(raw_uppers, max_tokens), lengths, self.quantile,
                               f"cross-conformal-{self.num_calibration_folds}")

    def predict_examples(self, examples: Sequence[LengthExample]) -> list[LengthPrediction]:
        if self.intercept_tokens is None:
            raise ValueError("PromptLengthLinearPredictor is not fitted: call fit() or load an artifact")
        if not examples:
            return []
        max_tokens = np.array([example.max_tokens for example in examples])
        raw = self._design(examples) @ np.array([self.intercept_tokens, self.tokens_per_prompt_token])  # [n]
        points = clamp_tokens(raw, max_tokens)
        uppers = self.calibrated_upper(raw + self.residual_upper_tokens, max_tokens)
        samples = np.clip(raw[:, None] + self.residual_quantiles[None, :], 0, max_tokens[:, None])  # [n, q]
        probs = bucket_histogram(samples, self.max_len)  # [n, 10]
        return [_prediction(p, u, row) for p, u, row in zip(points, uppers, probs)]

    def to_params(self) -> dict:
        return {"quantile": self.quantile, "max_len": self.max_len, "num_calibration_folds": self.num_calibration_folds,
                "intercept_tokens": self.intercept_tokens,
                "tokens_per_prompt_token": self.tokens_per_prompt_token,
                "residual_upper_tokens": self.residual_upper_tokens,
                "residual_quantiles": self.residual_quantiles.tolist()}

    @classmethod
    def from_params(cls, params: dict) -> "PromptLengthLinearPredictor":
        predictor = cls(params["quantile"], params["max_len"], params.get("num_calibration_folds", 0))
        predictor.intercept_tokens = float(params["intercept_tokens"])
        predictor.tokens_per_prompt_token = float(params["tokens_per_prompt_token"])
        predictor.residual_upper_tokens = float(params["residual_upper_tokens"])
        predictor.residual_quantiles = np.asarray(params["residual_quantiles"], dtype=np.float64)
        return predictor


class MaxTokensPrior(FittedLengthPredictor):
    """What is known of a model whose lengths were never measured: only each request's `max_tokens`. The bound is
    the worst case (max_tokens, so nothing overruns it), the point half of it, and the buckets uniform up to it. Not
    fitted and not saved: the service serves it until retraining on its own traffic promotes a learnt version.

    Args:
        max_len: longest sequence; the buckets span [0, max_len].
    """

    name = "prior"

    def __init__(self, max_len: int = DEFAULT_MAX_LEN) -> None:
        super().__init__()
        self.max_len = max_len

    def fit(self, examples: Sequence[LengthExample], lengths: Sequence[int]) -> "MaxTokensPrior":
        return self

    def predict_examples(self, examples: Sequence[LengthExample]) -> list[LengthPrediction]:
        predictions = []
        for example in examples:
            max_tokens = max(1, example.max_tokens)
            spread = np.linspace(1, max_tokens, num=64)  # the lengths it may take, evenly
            predictions.append(_prediction(max(1, max_tokens // 2), max_tokens, bucket_histogram(spread, self.max_len)))
        return predictions

    def to_params(self) -> dict:
        return {"max_len": self.max_len}

    @classmethod
    def from_params(cls, params: dict) -> "MaxTokensPrior":
        return cls(params["max_len"])
