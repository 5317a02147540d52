"""Conformal calibration of the upper bound: coverage measured on prompts the model did not fit.

A quantile model's bound undercovers on unseen prompts (it fits its own training
set). Split conformal prediction fixes that with one number: on calibration
examples the model did not see, take the log-space residual

    score_i = log1p(true_i) - log1p(raw_upper_i)

and the ceil((n + 1) * q)-th smallest score is an offset such that, for a new
exchangeable prompt, P(true <= expm1(log1p(raw_upper) + offset)) >= q. The offset
is multiplicative on (1 + length), so it widens long bounds more than short ones,
and it may be negative when the raw bound over-reserves.

Pure numpy: no model is imported here.
"""

import hashlib
import math
from dataclasses import asdict, dataclass

import numpy as np

# Fewer calibration examples than this give an offset too noisy to trust: keep the raw bound.
MIN_CALIBRATION_EXAMPLES = 10


@dataclass(frozen=True, slots=True)
class BoundCalibration:
    """A conformal log-space offset added to a predictor's raw upper bound.

    Attributes:
        quantile: the coverage the offset was chosen for.
        log_offset: added to log1p(raw upper bound); negative tightens the bound.
        num_calibration: examples the offset was computed on.
        raw_coverage: share of those examples within the raw (uncalibrated) bound.
        method: how the calibration examples were held out ("cross-conformal-5" or "split-conformal").
    """

    quantile: float
    log_offset: float
    num_calibration: int
    raw_coverage: float
    method: str

    def apply(self, raw_upper_tokens) -> np.ndarray:
        """The calibrated bounds (float, unclamped) for raw bounds in tokens."""
        raw = np.maximum(np.asarray(raw_upper_tokens, dtype=np.float64), 0.0)
        return np.expm1(np.log1p(raw) + self.log_offset)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> "BoundCalibration":
        unknown = set(values) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown calibration fields {sorted(unknown)}")
        return cls(**values)


def conformal_log_offset(raw_upper_tokens, true_tokens, quantile: float) -> float:
    """The split-conformal offset giving coverage >= `quantile` on exchangeable new examples.

    Args:
        raw_upper_tokens: the uncalibrated bounds on the calibration examples.
        true_tokens: their true output lengths.
        quantile: target coverage in (0, 1).

    Returns:
        The ceil((n + 1) * quantile)-th smallest log-space residual (the largest when
        that rank exceeds n, as the finite-sample guarantee would need +inf).
    """
    raw = np.maximum(np.asarray(raw_upper_tokens, dtype=np.float64), 0.0)
    true = np.asarray(true_tokens, dtype=np.float64)
    if raw.shape != true.shape or raw.ndim != 1 or len(raw) == 0:
        raise ValueError(f"need two equal non-empty 1-D arrays, got shapes {raw.shape} and {true.shape}")
    scores = np.sort(np.log1p(true) - np.log1p(raw))
    rank = min(len(scores), math.ceil((len(scores) + 1) * quantile))
    return float(scores[rank - 1])


def fit_calibration(raw_upper_tokens, true_tokens, quantile: float, method: str) -> BoundCalibration | None:
    """A BoundCalibration from held-out raw bounds, or None with too few examples to calibrate."""
    true = np.asarray(true_tokens, dtype=np.float64)
    if len(true) < MIN_CALIBRATION_EXAMPLES:
        return None
    raw = np.asarray(raw_upper_tokens, dtype=np.float64)
    return BoundCalibration(quantile=quantile, log_offset=conformal_log_offset(raw, true, quantile),
                            num_calibration=len(true), raw_coverage=float(np.mean(true <= raw)), method=method)


def fold_of(prompt_id: str, num_folds: int) -> int:
    """Calibration fold of a prompt: a salted hash of its id, so it is independent of the held-out split."""
    digest = hashlib.sha256(f"calibration:{prompt_id}".encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % num_folds


def is_calibration_example(prompt_id: str, fraction: float) -> bool:
    """Whether a prompt goes to the split-conformal calibration slice (a salted hash of its id)."""
    digest = hashlib.sha256(f"calibration:{prompt_id}".encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction
