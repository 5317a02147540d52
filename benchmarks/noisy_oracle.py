"""A benchmark instrument, not a product predictor: the true length with seeded log-normal error.

It lets scheduler benchmarks dial prediction quality (sigma) before a real
predictor exists, and sweep it to see how s3 degrades as predictions worsen.
"""

import math
import random
from statistics import NormalDist

from predictor_service.length_predictor import (DEFAULT_MAX_LEN, DEFAULT_QUANTILE, LengthPrediction, LengthPredictor,
                                               LengthQuery, bucket_edges)


class NoisyOraclePredictor(LengthPredictor):
    """point = true * exp(N(0, sigma)); upper bound = point * exp(z_quantile * sigma).

    With that bound the true length stays below it with probability `quantile`,
    as a calibrated predictor's bound would.

    Args:
        true_lengths: prompt_id -> true output length.
        sigma: log-normal error; 0 gives the exact length.
        quantile: coverage of the upper bound, in (0, 1).
        max_len: bucket range for `bucket_probs`.
        seed: seeds the error of each prompt (with its id), so results do not
            depend on call order.
    """

    name = "noisy_oracle"

    def __init__(self, true_lengths: dict[str, int], sigma: float, quantile: float = DEFAULT_QUANTILE,
                 max_len: int = DEFAULT_MAX_LEN, seed: int = 0) -> None:
        if sigma < 0:
            raise ValueError(f"sigma must be >= 0, got {sigma}")
        if not 0.0 < quantile < 1.0:
            raise ValueError(f"quantile must be in (0, 1), got {quantile}")
        self.true_lengths = dict(true_lengths)
        self.sigma = sigma
        self.quantile = quantile
        self.max_len = max_len
        self.seed = seed
        self._z = NormalDist().inv_cdf(quantile)

    def predict(self, queries: list[LengthQuery]) -> list[LengthPrediction]:
        return [self._predict_one(query) for query in queries]

    def _predict_one(self, query: LengthQuery) -> LengthPrediction:
        if query.prompt_id not in self.true_lengths:
            raise ValueError(f"noisy oracle knows no true length for prompt {query.prompt_id!r}")
        true_tokens = self.true_lengths[query.prompt_id]
        error = random.Random(f"{self.seed}:{query.prompt_id}").gauss(0.0, 1.0) * self.sigma
        point = true_tokens * math.exp(error)
        upper = point * math.exp(self._z * self.sigma)
        point_tokens = max(1, min(query.max_tokens, round(point)))
        upper_tokens = max(point_tokens, min(query.max_tokens, math.ceil(upper)))
        return LengthPrediction(point_tokens, upper_tokens, self._bucket_probs(point))

    def _bucket_probs(self, point: float) -> tuple[float, ...]:
        edges = bucket_edges(self.max_len)
        if self.sigma == 0:
            index = next((i for i, edge in enumerate(edges) if point <= edge), len(edges) - 1)
            return tuple(1.0 if i == index else 0.0 for i in range(len(edges)))
        dist = NormalDist(math.log(max(point, 1e-9)), self.sigma)
        cdfs = [dist.cdf(math.log(edge)) for edge in edges[:-1]] + [1.0]
        return tuple(hi - lo for lo, hi in zip([0.0] + cdfs[:-1], cdfs))
