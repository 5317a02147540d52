"""A request's output length as a distribution, and the work it still has ahead as decoding goes on.

A predictor gives a point (its median estimate) and an upper bound (a quantile of the same
distribution, `quantile`); between them they fix a log-normal for the output length L, cut
at max_tokens M (an answer that would run longer stops there, as half of SmolLM2's greedy
answers do):

    log L ~ Normal(mu = log point, sigma = log(upper / point) / z(quantile))

What a scheduler that wants shortest-remaining-first needs is not the point minus what was
decoded, which reaches zero and then jumps, but the remaining work *given that the answer is
still going* after d tokens:

    E[min(L, M) - d | L > d]

For a heavy tail it grows as d passes the point: a sequence that outran its prediction is
likely one that loops to the limit, and it no longer looks nearly done. A sequence that has
not yet reached its point keeps a remaining close to point - d. Pure: math only.
"""

import math
from dataclasses import dataclass

SQRT2 = math.sqrt(2.0)


def _upper_tail(x: float) -> float:
    """P(Z > x) for a standard normal Z, accurate far into the tail."""
    return 0.5 * math.erfc(x / SQRT2)


def normal_quantile(probability: float) -> float:
    """z with P(Z <= z) = probability, by bisection on the error function (no SciPy in the workers)."""
    if not 0.0 < probability < 1.0:
        raise ValueError(f"probability must be in (0, 1), got {probability}")
    low, high = -10.0, 10.0
    for _ in range(100):
        middle = (low + high) / 2
        if 1.0 - _upper_tail(middle) < probability:
            low = middle
        else:
            high = middle
    return (low + high) / 2


@dataclass(frozen=True, slots=True)
class LengthDistribution:
    """Log-normal output lengths around each request's point estimate.

    Attributes:
        default_sigma: the spread of log length when a request carries no upper bound (or one no
            larger than its point).
        quantile: the coverage of the upper bounds requests carry (the service's `quantile`).
    """

    default_sigma: float = 1.0
    quantile: float = 0.9

    def __post_init__(self) -> None:
        if self.default_sigma <= 0:
            raise ValueError(f"default_sigma must be > 0, got {self.default_sigma}")
        normal_quantile(self.quantile)  # raises for a quantile outside (0, 1)

    def sigma(self, point_tokens: int, upper_tokens: int | None) -> float:
        """The spread of one request's log length: from its upper bound when it has a larger one."""
        if upper_tokens is None or upper_tokens <= point_tokens:
            return self.default_sigma
        return math.log(upper_tokens / point_tokens) / normal_quantile(self.quantile)

    def remaining_of(self, predicted_tokens: int | None, num_decoded: int, max_tokens: int,
                     is_looping: bool = False) -> float:
        """`expected_remaining_tokens` of a request's current prediction; all it may still write without one, or
        once its answer repeats itself (`workers.scheduling.repetition`)."""
        if predicted_tokens is None or is_looping:
            return float(max(0, max_tokens - num_decoded))
        return self.expected_remaining_tokens(predicted_tokens, num_decoded, max_tokens)

    def expected_remaining_tokens(self, point_tokens: int, num_decoded: int, max_tokens: int,
                                  upper_tokens: int | None = None) -> float:
        """E[min(L, max_tokens) - num_decoded | L > num_decoded]: tokens still to come, given it is still going."""
        if num_decoded >= max_tokens:
            return 0.0
        mu = math.log(max(1, point_tokens))
        sigma = self.sigma(max(1, point_tokens), upper_tokens)
        above_decoded = _upper_tail((math.log(num_decoded) - mu) / sigma) if num_decoded > 0 else 1.0
        if above_decoded < 1e-300:
            return float(max_tokens - num_decoded)  # far past any length it was expected to have: a runaway
        log_max = math.log(max_tokens)
        # E[L; d < L < M] = exp(mu + sigma^2 / 2) * P(d < L' < M), L' shifted by sigma^2 (log-normal moments)
        shifted_decoded = (math.log(num_decoded) - mu - sigma**2) / sigma if num_decoded > 0 else -math.inf
        shifted_max = (log_max - mu - sigma**2) / sigma
        middle_mass = _upper_tail(shifted_decoded) - _upper_tail(shifted_max)
        partial_mean = math.exp(mu + sigma**2 / 2) * middle_mass
        at_max = max_tokens * _upper_tail((log_max - mu) / sigma)
        expected_total = (partial_mean + at_max) / above_decoded
        return min(float(max_tokens - num_decoded), max(0.0, expected_total - num_decoded))
