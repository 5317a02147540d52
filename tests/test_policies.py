"""Scheduling policies on synthetic request lists, driven without a model.

`simulate` plays the engine's part: it runs the scheduler's chunks, marks
their tokens computed, appends a fake token to every sequence whose known
tokens are all cached, and finishes sequences at their forced length.
"""

import random

import pytest

from workers.kv_cache_manager import BlockAllocator
from workers.policies import (
    MaxReservePolicy,
    OraclePolicy,
    PagedGreedyPolicy,
    S3PeakPolicy,
    S3Policy,
    SGLangRatioPolicy,
    make_policy,
    next_bound,
)
from workers.sampling_params import SamplingParams
from workers.scheduler import Scheduler, SchedulerConfig
from workers.scheduling_policy import PreemptionCostModel, PreemptionMode
from workers.sequence import Sequence, SequenceStatus

BLOCK_SIZE = 4
MAX_LEN = 256


def make_requests(num: int, seed: int = 0, prediction_error: float | None = 0.0) -> list[Sequence]:
    """Sequences with random prompt and forced output lengths; predicted bound = true * (1 + error)."""
    rng = random.Random(seed)
    seqs = []
    for i in range(num):
        prompt_len = rng.randint(1, 40)
        true_len = rng.randint(1, 120)
        predicted = None if prediction_error is None else max(1, int(true_len * (1 + prediction_error)))
        seqs.append(Sequence(
            seq_id=f"r{i}",
            prompt_token_ids=list(range(prompt_len)),
            params=SamplingParams(max_tokens=MAX_LEN - prompt_len, ignore_eos=True, forced_output_tokens=true_len),
            predicted_output_tokens=predicted,
        ))
    return seqs


def simulate(policy, seqs: list[Sequence], num_blocks: int, max_num_seqs: int = 64, max_steps: int = 20_000):
    """Run to completion; returns (scheduler, allocator, per-step running counts, swapped-out sequence ids)."""
    allocator = BlockAllocator(num_blocks, BLOCK_SIZE)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs, 64), allocator, policy)
    for seq in seqs:
        scheduler.add(seq)
    running_counts, swapped = [], set()
    for _ in range(max_steps):
        if not scheduler.has_unfinished():
            break
        out = scheduler.schedule()
        assert allocator.num_reserved_blocks <= num_blocks
        allocator.check_invariants()
        for seq, block_ids in out.swap_out:
            swapped.add(seq.seq_id)
        for seq, block_ids in out.swap_in:
            assert seq.seq_id in swapped
            assert len(block_ids) == allocator.blocks_for(seq.num_computed_tokens)
        running_counts.append(len(scheduler.running))
        for chunk in out.chunks:
            seq = chunk.seq
            samples = chunk.completes_sequence_tokens
            assert allocator.num_reserved_tokens(seq.seq_id) >= seq.num_computed_tokens + chunk.num_tokens
            seq.num_computed_tokens += chunk.num_tokens
            if samples:
                seq.output_token_ids.append(7)
                if seq.num_output_tokens == seq.params.forced_output_tokens:
                    seq.status = SequenceStatus.FINISHED
                    scheduler.finish(seq)
    assert not scheduler.has_unfinished(), "simulation did not finish"
    return scheduler, allocator, running_counts, swapped


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
    # Prefill 1 s/token and a free swap make swap cheaper; the reverse makes recompute cheaper.
    cost = (PreemptionCostModel(prefill_s_per_token=1.0, swap_bytes_per_s=1e18) if mode == "swap"
            else PreemptionCostModel(prefill_s_per_token=0.0, swap_bytes_per_s=1.0))
    seqs = make_requests(40, seed=4, prediction_error=-0.6)
    scheduler, allocator, _, swapped = simulate(S3Policy(bucket_tokens=25, cost_model=cost), seqs, num_blocks=60)
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


def test_s3_peak_with_exact_predictions_never_preempts_and_packs_more_than_s3():
    num_blocks = 3 * MAX_LEN // BLOCK_SIZE
    peak, allocator, peak_running, _ = simulate(S3PeakPolicy(bucket_tokens=25), make_requests(60, 6), num_blocks)
    _, _, s3_running, _ = simulate(S3Policy(bucket_tokens=25), make_requests(60, 6), num_blocks)
    assert peak.stats.num_preemptions == 0
    # Shortest-first admission leaves the longest requests for the end, where few run beside them.
    assert sum(peak_running) / len(peak_running) > 1.1 * sum(s3_running) / len(s3_running)
    assert allocator.num_free_blocks == allocator.num_blocks


def test_policies_that_hold_their_plan_take_the_upper_bound_the_others_the_point():
    assert S3Policy().prediction_from(point_tokens=40, upper_tokens=300) == 300
    assert MaxReservePolicy().prediction_from(40, 300) == 300
    assert S3PeakPolicy().prediction_from(40, 300) == 40  # an overrun only stretches its plan


def _waiting(seq_id: str, arrival_s: float, predicted: int, decoded: int = 0) -> Sequence:
    seq = Sequence(seq_id, list(range(10)), SamplingParams(max_tokens=500), arrival_s=arrival_s,
                   predicted_output_tokens=predicted)
    seq.output_token_ids = [7] * decoded
    return seq


def _kv_scarce(policy: S3PeakPolicy) -> S3PeakPolicy:
    """`policy` after its peak test refused a request in the last step."""
    huge = _waiting("huge", arrival_s=0.0, predicted=10_000)
    assert not policy.can_admit(huge, [], num_blocks=4, block_size=16, step_token_budget=64)
    policy.on_step([])
    return policy


def test_s3_peak_admits_the_shortest_predicted_remaining_first_and_ages_the_long_ones():
    policy = _kv_scarce(S3PeakPolicy(wait_s_per_token=0.1))
    long_old = _waiting("long_old", arrival_s=0.0, predicted=400)
    short_new = _waiting("short_new", arrival_s=5.0, predicted=100)
    mostly_done = _waiting("mostly_done", arrival_s=8.0, predicted=400, decoded=380)  # 20 to go (preempted)
    # 400 tokens weigh 40 s, 100 tokens 10 s: arriving 5 s later, the short one still goes first.
    assert [s.seq_id for s in policy.admission_order([long_old, short_new, mostly_done])] == [
        "mostly_done", "short_new", "long_old"]
    # Once the long one has waited more than 30 s longer than the short one, it goes first.
    short_late = _waiting("short_late", arrival_s=31.0, predicted=100)
    assert [s.seq_id for s in policy.admission_order([short_late, long_old])] == ["long_old", "short_late"]
    # At 0 s per token it is first come first served; the larger, the closer to shortest first.
    assert [s.seq_id for s in _kv_scarce(S3PeakPolicy(wait_s_per_token=0.0)).admission_order(
        [short_new, long_old])] == ["long_old", "short_new"]
    assert [s.seq_id for s in _kv_scarce(S3PeakPolicy(wait_s_per_token=10.0)).admission_order(
        [long_old, short_late])] == ["short_late", "long_old"]
    with pytest.raises(ValueError, match="wait_s_per_token"):
        S3PeakPolicy(wait_s_per_token=-1)


def test_s3_peak_admits_in_arrival_order_until_its_peak_test_refuses_and_for_a_window_after():
    policy = S3PeakPolicy(pressure_window_steps=3)
    long_old = _waiting("long_old", arrival_s=0.0, predicted=400)
    short_new = _waiting("short_new", arrival_s=5.0, predicted=100)
    queue = [long_old, short_new]
    fits = _waiting("fits", arrival_s=0.0, predicted=10)
    assert policy.can_admit(fits, [], num_blocks=4, block_size=16, step_token_budget=64)
    policy.on_step([])
    assert not policy.kv_scarce and policy.admission_order(queue) == queue  # room for all: as paging admits
    _kv_scarce(policy)
    orders = []
    for _ in range(5):  # no refusal since: scarce for the window's 3 steps, then arrival order again
        orders.append([s.seq_id for s in policy.admission_order(queue)])
        policy.on_step([])
    assert orders == [["short_new", "long_old"]] * 4 + [["long_old", "short_new"]]
    with pytest.raises(ValueError, match="pressure_window_steps"):
        S3PeakPolicy(pressure_window_steps=0)


def test_s3_peak_preempts_the_sequence_predicted_to_hold_its_blocks_longest():
    policy = S3PeakPolicy()
    near_end = _waiting("near_end", 0.0, predicted=300, decoded=290)
    long_left = _waiting("long_left", 1.0, predicted=300, decoded=20)
    grower = _waiting("grower", 2.0, predicted=50, decoded=40)
    assert policy.choose_victim(grower, [near_end, long_left, grower]) is long_left
    # Equal remaining: the one with less KV computed is cheaper to redo.
    twin = _waiting("twin", 3.0, predicted=300, decoded=20)
    twin.num_computed_tokens, long_left.num_computed_tokens = 5, 30
    assert policy.choose_victim(grower, [long_left, twin]) is twin
    # One preempted before goes last: the same long request is not pushed out each time it returns.
    twin.num_preemptions = 1
    assert policy.choose_victim(grower, [long_left, twin]) is long_left
    assert policy.choose_victim(grower, [twin, grower]) is grower


def test_s3_peak_under_pressure_preempts_long_predicted_ones_not_the_newest():
    # 4 blocks of 4 tokens. Planned to 16 and 7 tokens both fit (the short one ends before the long one
    # needs its 4th block); both outrun their bounds, and when the pool is full at 8 tokens each, the
    # long one (8 predicted to go) is preempted, not the short one (2 to go), admitted last.
    scheduler = Scheduler(SchedulerConfig(8, 64), BlockAllocator(4, 4), S3PeakPolicy(bucket_tokens=4))
    long = _waiting("long", 0.0, predicted=12)
    short = _waiting("short", 10.0, predicted=3)
    short.prompt_token_ids = long.prompt_token_ids = [1, 2, 3, 4]
    for seq in (long, short):
        scheduler.add(seq)
    admitted = []
    for _ in range(12):
        out = scheduler.schedule()
        admitted = admitted or [s.seq_id for s in scheduler.running]
        for chunk in out.chunks:
            samples = chunk.completes_sequence_tokens
            chunk.seq.num_computed_tokens += chunk.num_tokens
            if samples:
                chunk.seq.output_token_ids.append(7)
        if scheduler.stats.num_preemptions:
            break
    assert admitted == ["long", "short"]  # both fit: in arrival order
    assert scheduler.stats.num_preemptions == 1
    assert long.status is SequenceStatus.WAITING and short.status is SequenceStatus.RUNNING


def test_s3_peak_under_predictions_preempt_and_still_finish():
    seqs = make_requests(40, seed=7, prediction_error=-0.6)
    scheduler, allocator, _, _ = simulate(S3PeakPolicy(bucket_tokens=25), seqs, num_blocks=60)
    assert scheduler.stats.num_preemptions > 0 and scheduler.stats.mispredictions
    assert all(s.num_output_tokens == s.params.forced_output_tokens for s in seqs)
    assert allocator.num_free_blocks == allocator.num_blocks


def test_s3_peak_refuses_a_request_whose_growth_would_collide_with_running_ones():
    policy = S3PeakPolicy()
    # One running sequence: 8 tokens now, 40 at its end. Budget: 12 blocks of 4 tokens = 48 tokens.
    running = [Sequence("a", list(range(8)), SamplingParams(max_tokens=100), predicted_output_tokens=32)]
    small = Sequence("s", list(range(4)), SamplingParams(max_tokens=100), predicted_output_tokens=4)
    large = Sequence("l", list(range(4)), SamplingParams(max_tokens=100), predicted_output_tokens=20)
    assert policy.can_admit(small, running, num_blocks=12, block_size=4, step_token_budget=64)  # peak 40 + 8 tokens = 12 blocks
    assert not policy.can_admit(large, running, num_blocks=12, block_size=4, step_token_budget=64)  # both grow past 48 together


def test_s3_peak_plans_a_sequence_past_its_bound_with_the_next_bound():
    policy = S3PeakPolicy(bucket_tokens=8)
    # Bound 1 but already 6 tokens out, all inside its reserved blocks: it will keep growing.
    overrun = Sequence("a", list(range(4)), SamplingParams(max_tokens=100), predicted_output_tokens=1)
    overrun.output_token_ids = [7] * 6
    overrun.num_computed_tokens = 9
    newcomer = Sequence("b", list(range(4)), SamplingParams(max_tokens=100), predicted_output_tokens=4)
    # Planned as ending now (10 tokens, 3 blocks) both would fit in 4 blocks; planned to the next
    # bound (8 outputs, 12 tokens) it holds 3 blocks while the newcomer reaches 2.
    assert not policy.can_admit(newcomer, [overrun], num_blocks=4, block_size=4, step_token_budget=64)
    assert policy.can_admit(newcomer, [overrun], num_blocks=5, block_size=4, step_token_budget=64)


def test_s3_peak_counts_the_prefill_steps_of_a_chunked_prompt():
    policy = S3PeakPolicy()
    # 40-token prompt, 4-token answer: with 8 tokens per step it holds 10 blocks for ~5 steps, not 1.
    long_prompt = Sequence("p", list(range(40)), SamplingParams(max_tokens=100), predicted_output_tokens=4)
    short = Sequence("s", list(range(4)), SamplingParams(max_tokens=100), predicted_output_tokens=12)
    # short peaks at 16 tokens (4 blocks) after 12 steps, long_prompt has 11 blocks until it ends.
    assert policy.can_admit(short, [long_prompt], num_blocks=14, block_size=4, step_token_budget=64)
    assert not policy.can_admit(short, [long_prompt], num_blocks=14, block_size=4, step_token_budget=4)


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
    assert policy.planned_tokens_of(running[0]) == 32
    assert policy.can_admit(newcomer, running, num_blocks=16, block_size=4, step_token_budget=64)
    assert not policy.can_admit(newcomer, running, num_blocks=15, block_size=4, step_token_budget=64)
    policy.ratio = 0.25  # after some decay the running one is expected to need 8 more tokens
    assert policy.planned_tokens_of(running[0]) == 24
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
