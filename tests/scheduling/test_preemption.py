"""Preemption is the scheduler's, the same for every policy: swap within a bounded, counted host budget, beyond it
recompute. Pure: no torch."""

import pytest

from policy_driver import BLOCK_SIZE, make_requests, run_step, simulate
from workers.scheduling.kv_cache_manager import BlockAllocator
from workers.scheduling.policies import POLICY_NAMES, make_policy
from workers.scheduling.preemption import PreemptionCostModel, PreemptionRule, SwapSpace
from workers.scheduling.scheduler import Scheduler, SchedulerConfig
from workers.values.sampling_params import SamplingParams
from workers.values.sequence import Sequence

UNBOUNDED = 10**6
# Each policy set to preempt on this workload (its settings, KV blocks): under-predicted s3 plans; a ratio that
# trusts early finishes at once, in a pool where its newcomer's whole limit (64 blocks) leaves room for others.
PREEMPTING = {"paged_greedy": ({}, 72), "s3": ({"bucket_tokens": 25}, 72), "s3_peak": ({"bucket_tokens": 25}, 72),
              "sglang_ratio": ({"init_ratio": 0.0, "min_ratio": 0.0}, 160)}


@pytest.mark.parametrize("name", PREEMPTING)
def test_every_policy_swaps_under_the_swap_rule_and_recomputes_under_the_recompute_rule(name):
    results = {}
    settings, num_blocks = PREEMPTING[name]
    for mode in ("swap", "recompute"):
        seqs = make_requests(40, seed=21, prediction_error=-0.6)
        scheduler, allocator, _, swapped = simulate(make_policy(name, **settings), seqs, num_blocks,
                                                    preemption=PreemptionRule(mode, swap_space_blocks=UNBOUNDED))
        assert scheduler.stats.num_preemptions > 0, name
        assert all(s.num_output_tokens == s.params.forced_output_tokens for s in seqs)
        assert allocator.num_free_blocks == allocator.num_blocks
        results[mode] = (scheduler.stats, swapped)
    swap_stats, swapped = results["swap"]
    assert swapped and swap_stats.num_swaps > 0 and swap_stats.num_recomputed_tokens == 0
    recompute_stats, swapped = results["recompute"]
    assert not swapped and recompute_stats.num_swaps == 0 and recompute_stats.num_recomputed_tokens > 0


def test_the_auto_rule_follows_the_cost_model_for_every_policy():
    cheap_copy = PreemptionCostModel(prefill_s_per_token=1.0, swap_bytes_per_s=1e18, swap_overhead_s=0.0)
    slow_copy = PreemptionCostModel(prefill_s_per_token=0.0, swap_bytes_per_s=1.0)
    for cost, swaps in ((cheap_copy, True), (slow_copy, False)):
        seqs = make_requests(40, seed=22)
        scheduler, _, _, swapped = simulate(make_policy("paged_greedy"), seqs, num_blocks=40,
                                            preemption=PreemptionRule("auto", UNBOUNDED, cost))
        assert scheduler.stats.num_preemptions > 0
        assert bool(swapped) is swaps


def test_swap_space_is_bounded_counted_and_falls_back_to_recompute():
    budget_blocks = 12
    seqs = make_requests(40, seed=23, prediction_error=-0.6)
    allocator = BlockAllocator(60, BLOCK_SIZE)
    scheduler = Scheduler(SchedulerConfig(64, 64), allocator, make_policy("s3", bucket_tokens=25),
                          PreemptionRule("swap", swap_space_blocks=budget_blocks))
    for seq in seqs:
        scheduler.add(seq)
    host_blocks = {}  # what the engine would hold on the host, from the scheduler's own decisions
    for _ in range(20_000):
        if not scheduler.has_unfinished():
            break
        out = scheduler.schedule()
        for seq, block_ids in out.swap_in:
            host_blocks.pop(seq.seq_id)
        for seq, block_ids in out.swap_out:
            host_blocks[seq.seq_id] = len(block_ids)
        assert sum(host_blocks.values()) == scheduler.swap_space.num_blocks <= budget_blocks
        run_step(scheduler, out)
    assert not scheduler.has_unfinished()
    stats = scheduler.stats
    assert stats.num_swaps > 0, "the budget held some copies"
    assert stats.num_swaps_over_budget > 0 and stats.num_recomputed_tokens > 0, "and refused others"
    assert scheduler.swap_space.peak_blocks <= budget_blocks
    assert scheduler.swap_space.num_blocks == 0
    assert all(s.num_output_tokens == s.params.forced_output_tokens for s in seqs)


def test_no_swap_space_means_every_preemption_recomputes():
    seqs = make_requests(40, seed=24, prediction_error=-0.6)
    scheduler, _, _, swapped = simulate(make_policy("s3", bucket_tokens=25), seqs, num_blocks=60,
                                        preemption=PreemptionRule("swap", swap_space_blocks=0))
    assert not swapped and scheduler.stats.num_recomputed_tokens > 0
    assert scheduler.stats.num_swaps_over_budget == scheduler.stats.num_preemptions > 0


def test_kv_a_moved_request_brings_is_held_in_swap_space_until_it_is_admitted_or_aborted():
    scheduler = Scheduler(SchedulerConfig(4, 64), BlockAllocator(40, BLOCK_SIZE), make_policy("paged_greedy"),
                          PreemptionRule("swap", swap_space_blocks=8))
    moved = Sequence("moved", list(range(20)), SamplingParams(max_tokens=10, forced_output_tokens=5))
    moved.num_computed_tokens, moved.is_swapped = 19, True  # as Engine.add_request with exported KV
    scheduler.add(moved)
    assert scheduler.swap_space.num_blocks == -(-19 // BLOCK_SIZE)
    out = scheduler.schedule()
    assert [s.seq_id for s, _ in out.swap_in] == ["moved"] and scheduler.swap_space.num_blocks == 0
    aborted = Sequence("aborted", list(range(20)), SamplingParams(max_tokens=10))
    aborted.num_computed_tokens, aborted.is_swapped = 16, True
    scheduler.add(aborted)
    assert scheduler.swap_space.num_blocks == 4
    scheduler.finish(aborted)
    assert scheduler.swap_space.num_blocks == 0


def test_swap_space_ledger():
    space = SwapSpace(budget_blocks=10)
    space.hold("a", 6)
    assert space.fits(4) and not space.fits(5)
    space.hold("a", 3)  # a new copy replaces the old one
    space.hold("b", 5)
    assert (space.num_blocks, space.peak_blocks) == (8, 8)
    assert space.release("a") == 3 and space.release("a") == 0
    assert space.num_blocks == 5 and space.holds("b") and not space.holds("a")


def test_preemption_rule_refuses_unknown_modes_and_negative_budgets():
    with pytest.raises(ValueError, match="one of auto, swap, recompute, got 'copy'"):
        PreemptionRule("copy")
    with pytest.raises(ValueError, match="swap_space_blocks must be >= 0, got -1"):
        PreemptionRule("swap", swap_space_blocks=-1)


def test_no_policy_chooses_the_mechanism():
    # The mechanism is the scheduler's: a policy that chose it would make comparisons unequal again.
    assert all(not hasattr(make_policy(name), "preemption_mode") for name in POLICY_NAMES)
