"""Expected remaining output of a log-normal length cut at max_tokens, against a Monte Carlo reference."""

import math
import random

import pytest

from workers.scheduling.length_distribution import LengthDistribution, normal_quantile


def _monte_carlo_remaining(point: int, sigma: float, decoded: int, max_tokens: int, draws: int = 200_000) -> float:
    rng = random.Random(0)
    lengths = (min(max_tokens, math.exp(rng.gauss(math.log(point), sigma))) for _ in range(draws))
    still_going = [length - decoded for length in lengths if length > decoded]
    return sum(still_going) / len(still_going)


@pytest.mark.parametrize("point, sigma, decoded, max_tokens", [
    (100, 0.6, 0, 512), (100, 0.6, 80, 512), (100, 1.0, 150, 512), (40, 1.2, 200, 1024), (300, 0.3, 10, 400),
])
def test_expected_remaining_matches_sampling(point, sigma, decoded, max_tokens):
    expected = LengthDistribution(default_sigma=sigma).expected_remaining_tokens(point, decoded, max_tokens)
    assert expected == pytest.approx(_monte_carlo_remaining(point, sigma, decoded, max_tokens), rel=0.02)


def test_a_sequence_that_outran_its_prediction_looks_further_from_done_not_nearly_done():
    narrow, heavy = LengthDistribution(default_sigma=0.5), LengthDistribution(default_sigma=1.0)
    assert narrow.expected_remaining_tokens(50, 40, 512) < 0.6 * narrow.expected_remaining_tokens(50, 0, 512)
    remaining = [heavy.expected_remaining_tokens(50, decoded, 512) for decoded in (0, 40, 100, 300)]
    # A heavy tail: past the point it is not "point minus decoded" (negative) but more than at the start, and
    # ever more likely to run to the limit.
    assert remaining[2] > remaining[0] and remaining[3] > remaining[2]
    assert remaining[3] / (512 - 300) > remaining[2] / (512 - 100)
    lengths = heavy
    assert lengths.expected_remaining_tokens(50, 512, 512) == 0.0
    assert 500 - 500 < lengths.expected_remaining_tokens(2, 500, 512) <= 12.0  # far past: near the limit
    assert LengthDistribution(default_sigma=0.1).expected_remaining_tokens(2, 500, 512) == 12.0  # beyond all mass


def test_an_upper_bound_sets_the_spread_and_none_means_all_of_max_tokens():
    lengths = LengthDistribution(default_sigma=0.5, quantile=0.9)
    assert lengths.sigma(100, None) == 0.5 and lengths.sigma(100, 100) == 0.5
    assert lengths.sigma(100, 300) == pytest.approx(math.log(3) / 1.2815515655, rel=1e-6)
    assert lengths.remaining_of(None, 10, 200) == 190.0
    assert normal_quantile(0.5) == pytest.approx(0.0, abs=1e-9)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="default_sigma must be > 0"):
        LengthDistribution(default_sigma=0)
    with pytest.raises(ValueError, match=r"probability must be in \(0, 1\)"):
        LengthDistribution(quantile=1.0)
