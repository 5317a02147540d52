"""The interface every output-length predictor implements.

The scheduler reserves KV for prompt + `upper_bound_tokens`; the point
estimate orders and reports, the bucket probabilities feed calibration.
"""

import abc
from dataclasses import dataclass

DEFAULT_QUANTILE = 0.9  # the coverage of a predictor's upper bound unless configured (the service's `quantile`)
DEFAULT_MAX_LEN = 1024  # the longest output a predictor's length buckets cover unless configured


@dataclass(frozen=True, slots=True)
class LengthQuery:
    """What a predictor sees of a request.

    Attributes:
        prompt_id: stable id of the prompt (labels and evaluation join on it).
        prompt_token_ids: the chat-templated prompt.
        max_tokens: the request's generation limit; predictions never exceed it.
        temperature: sampling temperature (lengths vary with it).
    """

    prompt_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    temperature: float = 0.0


@dataclass(frozen=True, slots=True)
class LengthPrediction:
    """A predicted output length.

    Attributes:
        point_tokens: point estimate of the output length.
        upper_bound_tokens: the length not exceeded with the configured probability.
        bucket_probs: probability of each of the equal-width length buckets.
    """

    point_tokens: int
    upper_bound_tokens: int
    bucket_probs: tuple[float, ...]


class LengthPredictor(abc.ABC):
    """Predicts output lengths for a batch of queries."""

    name: str = "abstract"

    @abc.abstractmethod
    def predict(self, queries: list[LengthQuery]) -> list[LengthPrediction]:
        """One prediction per query, in order."""


def bucket_edges(max_len: int, num_buckets: int = 10) -> list[int]:
    """Upper edges of equal-width buckets over [0, max_len] (the S3 paper uses 10)."""
    width = max_len / num_buckets
    return [round(width * (i + 1)) for i in range(num_buckets)]
