"""The future peak of a set of KV plans, for `S3PeakPolicy.can_admit` (pure, no torch).

A plan is `(held, final, delay)` in tokens and steps: the sequence holds `held` tokens now,
waits `delay` steps (prefill chunks) before growing one token per step, and leaves once it
holds `final` tokens, `end = delay + final - held` steps from now. In blocks of `block_size`
tokens it holds, at step t (while t <= end):

    ceil(min(held + max(0, t - delay), final) / block_size)

Use only rises until someone leaves, so the peak of the sum falls on some plan's `end`; those
are the only steps checked. Summing every plan at every end costs O(n^2); here one sweep over
the ends in order keeps three groups: plans still waiting to grow (a constant each), plans
growing (ceil((held - delay + t) / block_size) each), and plans ending now (their final
blocks). The growing group's sum is kept in closed form,

    sum_i floor((a_i + t) / B) = (sum_i a_i + k t - sum_i r_i - k s + B * #{i: r_i >= B - s}) / B,

with a_i = held_i - delay_i + B - 1, r_i = a_i mod B, s = t mod B and k growing plans, so a
step costs O(B) whatever n is: O(n log n + n B) in all.
"""

from collections.abc import Iterator, Sequence

Plan = tuple[int, int, int]  # (held tokens, final tokens, delay steps)


def _ceil_div(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def planned_totals(plans: Sequence[Plan], block_size: int) -> Iterator[tuple[int, int]]:
    """(step, blocks all plans hold then) at each distinct plan end, in step order."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    ends = [delay + final - held for held, final, delay in plans]
    by_end = sorted(range(len(plans)), key=ends.__getitem__)
    by_delay = sorted(range(len(plans)), key=lambda i: plans[i][2])
    waiting = [True] * len(plans)  # not yet growing (nor gone)
    waiting_blocks = sum(_ceil_div(min(held, final), block_size) for held, final, _ in plans)
    residues = [0] * block_size
    sum_a = sum_r = num_growing = 0
    next_end = next_delay = 0
    while next_end < len(by_end):
        step = ends[by_end[next_end]]
        ending_blocks = 0
        while next_end < len(by_end) and ends[by_end[next_end]] == step:
            i = by_end[next_end]
            held, final, delay = plans[i]
            ending_blocks += _ceil_div(final, block_size)
            if waiting[i]:
                waiting_blocks -= _ceil_div(min(held, final), block_size)
            else:
                a = held - delay + block_size - 1
                sum_a, sum_r, num_growing = sum_a - a, sum_r - a % block_size, num_growing - 1
                residues[a % block_size] -= 1
            waiting[i] = False
            next_end += 1
        while next_delay < len(by_delay) and plans[by_delay[next_delay]][2] < step:
            i = by_delay[next_delay]
            next_delay += 1
            if not waiting[i]:  # gone already
                continue
            held, final, delay = plans[i]
            waiting_blocks -= _ceil_div(min(held, final), block_size)
            a = held - delay + block_size - 1
            sum_a, sum_r, num_growing = sum_a + a, sum_r + a % block_size, num_growing + 1
            residues[a % block_size] += 1
            waiting[i] = False
        s = step % block_size
        wrapped = sum(residues[block_size - s:]) if s else 0
        growing_blocks = (sum_a + num_growing * step - sum_r - num_growing * s + block_size * wrapped) // block_size
        yield step, waiting_blocks + growing_blocks + ending_blocks


def holds_at_least(a: Plan, b: Plan) -> bool:
    """Plan `a` holds at least as many blocks as plan `b` at every step `b` holds any, whatever the block size: it
    holds as much now, grows no later, plans as much and ends no sooner. So if the plans beside `b` exceeded a
    budget, those beside `a` do too."""
    (held_a, final_a, delay_a), (held_b, final_b, delay_b) = a, b
    return (held_a >= held_b and final_a >= final_b and delay_a <= delay_b
            and delay_a + final_a - held_a >= delay_b + final_b - held_b)


def peak_fits(plans: Sequence[Plan], block_size: int, num_blocks: int) -> bool:
    """Whether the plans together never hold more than `num_blocks` blocks at any future step."""
    if sum(_ceil_div(final, block_size) for _, final, _ in plans) <= num_blocks:
        return True  # even all at their finals at once
    return all(total <= num_blocks for _, total in planned_totals(plans, block_size))
