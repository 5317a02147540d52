"""Scheduling policies on synthetic request lists, driven without a model (`policy_driver`).

s3_peak's own tests are in `test_s3_peak_policy.py`.
"""

import random

import pytest

from policy_driver import BLOCK_SIZE, MAX_LEN, make_requests, simulate
from workers.scheduling.kv_cache_manager import BlockAllocator
from workers.scheduling.policies import MaxReservePolicy, OraclePolicy, PagedGreedyPolicy, make_policy
from workers.scheduling.preemption import PreemptionCostModel, PreemptionMode, PreemptionRule
from workers.scheduling.s3_peak import S3PeakPolicy
from workers.scheduling.s3_policy import S3Policy, next_bound
from workers.scheduling.scheduler import Scheduler, SchedulerConfig
from workers.scheduling.sglang_ratio import SGLangRatioPolicy
from workers.values.sampling_params import SamplingParams
from workers.values.sequence import Sequence, SequenceStatus


def test_max_reserve_never_preempts_and_stays_in_budget():
    seqs = make_requests(30, seed=1)
    scheduler, allocator, running, _ = simulate(MaxReservePolicy(), seqs, num_blocks=3 * MAX_LEN // BLOCK_SIZE)
    assert scheduler.stats.num_preemptions == 0
    assert max(running) <= 3  # each reserves a whole max-length sequence
    assert all(s.num_output_tokens == s.params.forced_output_tokens for s in seqs)
    assert allocator.num_free_blocks == allocator.num_blocks


def test_oracle_never_preempts():
    seqs = make_requests(40, seed=2)
    scheduler, allocator, _, _ = simulate(OraclePolicy(), seqs, num_blocks=120)
    assert scheduler.stats.num_preemptions == 0
    assert allocator.num_free_blocks == allocator.num_blocks


def test_s3_with_exact_predictions_never_preempts_and_packs_more_than_max_reserve():
    num_blocks = 3 * MAX_LEN // BLOCK_SIZE
    s3_scheduler, allocator, s3_running, _ = simulate(S3Policy(bucket_tokens=25), make_requests(40, 3), num_blocks)
    _, _, max_running, _ = simulate(MaxReservePolicy(), make_requests(40, 3), num_blocks)
    assert s3_scheduler.stats.num_preemptions == 0
    assert s3_scheduler.stats.mispredictions == []
    assert sum(s3_running) / len(s3_running) > 2 * sum(max_running) / len(max_running)
    assert allocator.num_free_blocks == allocator.num_blocks


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_s3_under_predictions_preempt_requeue_and_finish_with_right_lengths(mode):
    seqs = make_requests(40, seed=4, prediction_error=-0.6)
    scheduler, allocator, _, swapped = simulate(S3Policy(bucket_tokens=25), seqs, num_blocks=60,
                                                preemption=PreemptionRule(mode, swap_space_blocks=10**6))
    stats = scheduler.stats
    assert stats.num_preemptions > 0
    assert len(stats.mispredictions) > 0
    event = stats.mispredictions[0]
    assert event.predicted_output_tokens is not None and event.num_output_tokens > event.predicted_output_tokens
    assert all(s.num_output_tokens == s.params.forced_output_tokens for s in seqs)
    assert any(s.num_preemptions > 0 for s in seqs)
    if mode == "swap":
        assert swapped and stats.num_swapped_blocks > 0 and stats.num_recomputed_tokens == 0
    else:
        assert not swapped and stats.num_recomputed_tokens > 0
    assert allocator.num_free_blocks == allocator.num_blocks


def test_paged_greedy_preempts_newest_and_recomputes_under_pressure():
    seqs = make_requests(40, seed=5)
    scheduler, allocator, _, swapped = simulate(PagedGreedyPolicy(), seqs, num_blocks=40)
    assert scheduler.stats.num_preemptions > 0
    assert scheduler.stats.num_recomputed_tokens > 0 and not swapped
    assert all(s.num_output_tokens == s.params.forced_output_tokens for s in seqs)
    assert allocator.num_free_blocks == allocator.num_blocks


@pytest.mark.parametrize("name", ["max_reserve", "paged_greedy", "s3", "s3_peak", "sglang_ratio", "oracle"])
@pytest.mark.parametrize("seed", [10, 11, 12])
def test_no_policy_leaks_blocks(name, seed):
    seqs = make_requests(25, seed=seed, prediction_error=random.Random(seed).uniform(-0.7, 0.7))
    _, allocator, _, _ = simulate(make_policy(name), seqs, num_blocks=MAX_LEN // BLOCK_SIZE + 8)
    allocator.check_invariants()
    assert allocator.num_free_blocks == allocator.num_blocks
    assert all(s.num_output_tokens == s.params.forced_output_tokens for s in seqs)


def test_s3_admits_largest_predicted_first_and_first_fit():
    big = Sequence("big", list(range(10)), SamplingParams(max_tokens=200), predicted_output_tokens=150)
    mid = Sequence("mid", list(range(10)), SamplingParams(max_tokens=200), predicted_output_tokens=30)
    small = Sequence("small", list(range(10)), SamplingParams(max_tokens=200), predicted_output_tokens=5)
    policy = S3Policy()
    assert [s.seq_id for s in policy.admission_order([small, big, mid])] == ["big", "mid", "small"]
    # 20 blocks of 4 tokens: big (160 tokens = 40 blocks) cannot fit; first fit goes on to the others.
    scheduler = Scheduler(SchedulerConfig(8, 64), BlockAllocator(20, 4), policy)
    for seq in (small, big, mid):
        scheduler.add(seq)
    scheduler.schedule()
    assert [s.seq_id for s in scheduler.running] == ["mid", "small"]
    assert [s.seq_id for s in scheduler.waiting] == ["big"]


def test_next_bound_moves_to_a_larger_bucket_within_max_tokens():
    assert next_bound(current_bound=50, num_output_tokens=51, max_tokens=1000, bucket_tokens=100) == 100
    assert next_bound(current_bound=100, num_output_tokens=101, max_tokens=1000, bucket_tokens=100) == 200
    assert next_bound(current_bound=700, num_output_tokens=701, max_tokens=900, bucket_tokens=100) == 900


def test_cost_model_prefers_swap_when_copying_is_cheaper():
    cheap_copy = PreemptionCostModel(prefill_s_per_token=1e-3, swap_bytes_per_s=1e10, kv_bytes_per_token=1000)
    slow_copy = PreemptionCostModel(prefill_s_per_token=1e-6, swap_bytes_per_s=1e6, kv_bytes_per_token=1000)
    assert cheap_copy.cheaper_mode(100) is PreemptionMode.SWAP
    assert slow_copy.cheaper_mode(100) is PreemptionMode.RECOMPUTE


def test_make_policy_rejects_unknown_names():
    with pytest.raises(ValueError, match="unknown policy 'fifo'"):
        make_policy("fifo")


def test_oracle_requires_the_true_length():
    seq = Sequence("x", [1, 2], SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="forced_output_tokens"):
        OraclePolicy().reservation_tokens(seq)


def test_policies_that_hold_their_plan_take_the_upper_bound_the_others_the_point():
    assert S3Policy().prediction_from(point_tokens=40, upper_tokens=300) == 300
    assert MaxReservePolicy().prediction_from(40, 300) == 300
    assert S3PeakPolicy().prediction_from(40, 300) == 40  # an overrun only stretches its plan


# -- sglang_ratio ---------------------------------------------------------------------------


def _running(seq_id: str, num_prompt: int, num_output: int, max_tokens: int) -> Sequence:
    seq = Sequence(seq_id, list(range(num_prompt)), SamplingParams(max_tokens=max_tokens))
    seq.output_token_ids = [7] * num_output
    seq.num_computed_tokens = seq.num_tokens
    seq.status = SequenceStatus.RUNNING
    return seq


def test_sglang_ratio_decays_step_by_step_to_its_floor_and_returns_to_the_start_when_idle():
    policy = SGLangRatioPolicy(init_ratio=0.7, min_ratio=0.1, decay_steps=6)
    busy = [_running("a", 4, 0, 50)]
    ratios = []
    for _ in range(8):
        policy.on_step(busy)
        ratios.append(round(policy.ratio, 6))
    assert ratios == [0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.1, 0.1]
    policy.on_step([])
    assert policy.ratio == 0.7


def test_sglang_ratio_charges_the_newcomer_its_limit_and_the_running_their_remaining_times_ratio():
    policy = SGLangRatioPolicy(init_ratio=0.5, min_ratio=0.1)
    running = [_running("a", 8, 8, 40)]  # holds 16 tokens, 32 remaining: planned 16 + 16 = 32 tokens = 8 blocks
    newcomer = Sequence("n", list(range(8)), SamplingParams(max_tokens=24))  # 8 + 24 = 32 tokens = 8 blocks
    assert policy.expected_tokens_of(running[0]) == 32
    assert policy.can_admit(newcomer, running, num_blocks=16, block_size=4, step_token_budget=64)
    assert not policy.can_admit(newcomer, running, num_blocks=15, block_size=4, step_token_budget=64)
    policy.ratio = 0.25  # after some decay the running one is expected to need 8 more tokens
    assert policy.expected_tokens_of(running[0]) == 24
    assert policy.planned_tokens_of(running[0]) == 32  # the rule the controller shares stays at init_ratio
    assert policy.can_admit(newcomer, running, num_blocks=14, block_size=4, step_token_budget=64)


def test_sglang_ratio_retracts_the_fewest_decoded_then_the_longest_prompt():
    policy = SGLangRatioPolicy()
    a, b, c = _running("a", 4, 30, 100), _running("b", 4, 2, 100), _running("c", 20, 2, 100)
    assert policy.choose_victim(a, [a, b, c]) is c  # 2 decoded each: the longer prompt goes
    assert policy.choose_victim(a, [a, b]) is b


def test_sglang_ratio_resets_after_a_retraction_from_what_the_running_ones_decoded():
    policy = SGLangRatioPolicy(init_ratio=0.7, min_ratio=0.1, retract_steps=20)
    policy.ratio = 0.1
    staying = [_running("a", 4, 60, 200), _running("b", 4, 100, 200)]
    policy.on_preempted(_running("v", 4, 1, 200), staying)
    assert policy.ratio == pytest.approx((60 + 100 + 2 * 20) / 400)


def test_sglang_ratio_in_the_scheduler_retracts_recomputes_and_finishes_everything():
    def requests() -> list[Sequence]:  # no predictions: the policy never reads one
        return [Sequence(f"r{i}", list(range(rng_i.randint(4, 30))),
                         SamplingParams(max_tokens=130, ignore_eos=True, forced_output_tokens=rng_i.randint(60, 130)))
                for i, rng_i in ((i, random.Random(1000 * 8 + i)) for i in range(30))]

    seqs = requests()
    scheduler, allocator, running, _ = simulate(SGLangRatioPolicy(decay_steps=50), seqs, num_blocks=100)
    assert scheduler.stats.num_preemptions > 0  # the ratio decayed below what the answers needed
    assert scheduler.stats.num_recomputed_tokens > 0
    assert all(s.num_output_tokens == s.params.forced_output_tokens for s in seqs)
    assert allocator.num_free_blocks == allocator.num_blocks
    _, _, max_running, _ = simulate(MaxReservePolicy(), requests(), num_blocks=100)
    assert sum(running) / len(running) > 1.2 * sum(max_running) / len(max_running)  # it packs more than the worst case


def test_oracle_can_take_the_true_length_as_the_prediction_when_nothing_is_forced():
    seq = Sequence("x", [1, 2], SamplingParams(max_tokens=100), predicted_output_tokens=30)
    assert OraclePolicy(from_prediction=True).reservation_tokens(seq) == 32
    assert OraclePolicy(from_prediction=True).planned_tokens(2, 0, 100, 30) == 32
    with pytest.raises(ValueError, match="needs predicted_output_tokens"):
        OraclePolicy(from_prediction=True).reservation_tokens(Sequence("y", [1], SamplingParams(max_tokens=9)))


def test_the_controller_is_charged_the_plan_except_where_the_worker_admits_by_its_own_test():
    for name in ("max_reserve", "paged_greedy", "s3"):
        policy = make_policy(name, max_model_len=1024)
        assert not policy.admits_at_worker
        assert policy.placement_tokens(20, 5, 200, 40) == policy.planned_tokens(20, 5, 200, 40), name
    peak = make_policy("s3_peak", max_model_len=1024)
    assert peak.admits_at_worker and peak.planned_tokens(20, 5, 200, 40) == 60
    assert peak.placement_tokens(20, 5, 200, 40) == 25  # what it holds on admission: prompt + resumed output
    sglang = make_policy("sglang_ratio")  # its ratio lives in the worker's copy: the controller's never decays
    assert sglang.admits_at_worker and sglang.planned_tokens(20, 5, 200, 40) == 20 + 5 + 137  # 195 x 0.7, rounded up
    assert sglang.placement_tokens(20, 5, 200, 40) == 25
    with pytest.raises(ValueError, match="num_output_tokens must be in"):
        peak.placement_tokens(20, 200, 200, 40)  # checked as the plan is
