"""The future peak of KV plans: the sweep against summing every plan at every end."""

import random

import pytest

from workers.scheduling.kv_peak import holds_at_least, peak_fits, planned_totals


def _brute_totals(plans, block_size):
    """The definition: at each distinct end, every plan still there, in blocks."""
    return [(end, sum(-(-min(held + max(0, end - delay), final) // block_size)
                      for held, final, delay in plans if delay + final - held >= end))
            for end in sorted({delay + final - held for held, final, delay in plans})]


def _random_plans(rng: random.Random, n: int) -> list[tuple[int, int, int]]:
    plans = []
    for _ in range(n):
        held = rng.randint(0, 300)
        final = held + rng.randint(0, 400) if rng.random() > 0.1 else rng.randint(0, held)  # some past their plan
        plans.append((held, final, rng.choice((0, 0, 0, rng.randint(1, 20)))))
    return plans


@pytest.mark.parametrize("block_size", [1, 4, 16, 17])
def test_the_sweep_gives_the_definitions_totals_at_every_end(block_size):
    rng = random.Random(block_size)
    for n in (1, 2, 3, 10, 60):
        for _ in range(40):
            plans = _random_plans(rng, n)
            assert list(planned_totals(plans, block_size)) == _brute_totals(plans, block_size), plans


def test_fits_matches_the_definition_at_and_around_the_peak():
    rng = random.Random(7)
    for _ in range(300):
        plans, block_size = _random_plans(rng, rng.randint(1, 30)), rng.choice((4, 16))
        peak = max(total for _, total in _brute_totals(plans, block_size))
        assert peak_fits(plans, block_size, peak)
        assert not peak_fits(plans, block_size, peak - 1)


def test_two_sequences_growing_into_each_other():
    # a: 8 tokens now, 40 at its end (step 32); b: 4 now, 24 at its end (step 20). Blocks of 4.
    plans = [(8, 40, 0), (4, 24, 0)]
    assert list(planned_totals(plans, 4)) == [(20, 7 + 6), (32, 10)]
    assert peak_fits(plans, 4, 13) and not peak_fits(plans, 4, 12)
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        list(planned_totals(plans, 0))


def _blocks_at(plan, step, block_size):
    held, final, delay = plan
    if step > delay + final - held:
        return 0
    return -(-min(held + max(0, step - delay), final) // block_size)


def test_a_plan_that_holds_at_least_another_holds_as_many_blocks_at_every_step_and_fails_where_it_fails():
    rng = random.Random(3)
    compared = 0
    for _ in range(3000):
        a, b = _random_plans(rng, 2)
        if rng.random() < 0.5:  # near misses: b grown by a little in one field
            held, final, delay = b
            a = (held + rng.randint(0, 3), final + rng.randint(-2, 5), max(0, delay + rng.randint(-2, 1)))
        if not holds_at_least(a, b):
            continue
        compared += 1
        block_size = rng.choice((1, 4, 16))
        horizon = max(p[2] + p[1] - p[0] for p in (a, b)) + 2
        assert all(_blocks_at(a, t, block_size) >= _blocks_at(b, t, block_size) for t in range(horizon)), (a, b)
        others = _random_plans(rng, rng.randint(0, 8))
        for budget in range(0, 60, 3):
            if not peak_fits([*others, b], block_size, budget):
                assert not peak_fits([*others, a], block_size, budget), (a, b, others, budget)
    assert compared > 300
    assert holds_at_least((10, 51, 0), (10, 50, 1))  # grows a step sooner and ends with it
    assert not holds_at_least((12, 50, 0), (10, 50, 0))  # more held now but it ends sooner
