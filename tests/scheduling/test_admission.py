"""Admission liveness, without a model: a large request is not starved by small ones passing it (first-fit
policies), and a more urgent request takes a slot from a less urgent one when `max_num_seqs` is the limit."""

import pytest

from policy_driver import run_step
from workers.scheduling.kv_cache_manager import BlockAllocator
from workers.scheduling.s3_peak import S3PeakPolicy
from workers.scheduling.s3_policy import S3Policy
from workers.scheduling.scheduler import Scheduler, SchedulerConfig
from workers.values.sampling_params import SamplingParams
from workers.values.sequence import Sequence, SequenceStatus

BLOCK_SIZE = 4


def request(seq_id: str, num_output_tokens: int, priority: int = 0) -> Sequence:
    """A 10-token prompt answered in exactly `num_output_tokens`, predicted exactly."""
    return Sequence(seq_id, list(range(10)), SamplingParams(max_tokens=200, forced_output_tokens=num_output_tokens),
                    predicted_output_tokens=num_output_tokens, priority=priority)


def step(scheduler: Scheduler) -> None:
    run_step(scheduler, scheduler.schedule())


def steps_until_admitted(policy, medium: int, max_overtaken_steps: int, max_steps: int = 1000,
                         preempted_first: bool = True) -> int | None:
    """A request of `medium` output tokens running, a large one waiting, and another medium one queued behind
    it whenever fewer than two wait; the step the large one starts, if it does."""
    # 30 blocks of 4 tokens: the large one (110 tokens, 28 blocks) fits beside nobody, while a medium one
    # gets in beside the one running as that one nears its end.
    scheduler = Scheduler(SchedulerConfig(16, 64, max_overtaken_steps, preempted_first=preempted_first),
                          BlockAllocator(30, BLOCK_SIZE), policy)
    scheduler.add(request("first", medium))
    step(scheduler)
    large = request("large", 100)
    scheduler.add(large)
    for index in range(max_steps):
        if len(scheduler.waiting) < 2:
            scheduler.add(request(f"next{index}", medium))
        step(scheduler)
        if large.status is not SequenceStatus.WAITING:
            return index
    return None


# s3 holds whole plans, so two 50-token requests (13 blocks each) run side by side; s3_peak overlaps a
# newcomer with the end of the one running, so there 70-token ones (18 blocks) keep the large one out. s3_peak
# checks the peak against the pool itself here (no overcommit, which would let the large one in on its own).
@pytest.mark.parametrize("policy_class, medium, options",
                         [(S3Policy, 40, {}), (S3PeakPolicy, 60, {"overcommit_step": 0.0})])
def test_a_large_request_passed_long_enough_is_admitted_before_later_ones(policy_class, medium, options):
    # Without the guard, one of the others always runs and the large one never gets in.
    assert steps_until_admitted(policy_class(bucket_tokens=16, **options), medium, max_overtaken_steps=10**9) is None
    admitted_at = steps_until_admitted(policy_class(bucket_tokens=16, **options), medium, max_overtaken_steps=100)
    # First passed within `medium` steps; 100 steps later nobody passes it, and those running end within
    # `medium` more.
    assert admitted_at is not None and 100 <= admitted_at <= medium + 100 + medium


def test_s3_peak_stretching_its_budget_lets_a_large_request_in_without_the_guard():
    # Refused step after step, the budget grows until the large one fits beside a medium one, where the medium ones
    # the stretch's preemptions push out wait behind it (preempted_first off).
    admitted_at = steps_until_admitted(S3PeakPolicy(bucket_tokens=16), 60, max_overtaken_steps=10**9,
                                       preempted_first=False)
    assert admitted_at is not None and admitted_at < 100
    # With victims back first (the default) they return ahead of it each time the stretch overshoots, and the
    # stretch alone never lets it in: the guard does, once it has been passed for its steps.
    assert steps_until_admitted(S3PeakPolicy(bucket_tokens=16), 60, max_overtaken_steps=10**9) is None
    admitted_at = steps_until_admitted(S3PeakPolicy(bucket_tokens=16), 60, max_overtaken_steps=100)
    assert admitted_at is not None and 100 <= admitted_at <= 60 + 100 + 60


def test_the_guard_starts_only_once_someone_passed():
    scheduler = Scheduler(SchedulerConfig(16, 64, 5), BlockAllocator(30, BLOCK_SIZE), S3Policy(bucket_tokens=16))
    blocker, large = request("blocker", 50), request("large", 100)
    scheduler.add(blocker)
    step(scheduler)
    scheduler.add(large)
    for _ in range(20):  # nobody else waits: it does not fit, but nobody passes it either
        step(scheduler)
    assert large.first_passed_step is None and large.status is SequenceStatus.WAITING
    small = request("small", 2)
    scheduler.add(small)
    step(scheduler)  # small fits beside the blocker and passes it
    assert small.status is SequenceStatus.RUNNING and large.first_passed_step == scheduler.num_steps
    while large.status is SequenceStatus.WAITING:
        step(scheduler)
    assert large.first_passed_step is None  # reset once it runs


def test_a_more_urgent_request_getting_in_first_is_priority_not_a_pass():
    scheduler = Scheduler(SchedulerConfig(16, 64, 5), BlockAllocator(30, BLOCK_SIZE), S3Policy(bucket_tokens=16))
    blocker, batch = request("blocker", 50, priority=5), request("batch", 100, priority=5)
    for seq in (blocker, batch):
        scheduler.add(seq)
    step(scheduler)
    urgent = request("urgent", 2, priority=0)
    scheduler.add(urgent)
    step(scheduler)  # the urgent one fits beside the blocker and gets in ahead of the waiting batch request
    assert urgent.status is SequenceStatus.RUNNING and batch.first_passed_step is None
    same_class = request("same-class", 2, priority=5)
    scheduler.add(same_class)
    step(scheduler)  # one of its own class passing it starts the clock
    assert same_class.status is SequenceStatus.RUNNING and batch.first_passed_step == scheduler.num_steps


def test_an_urgent_request_takes_a_slot_from_a_less_urgent_one_when_slots_are_the_limit():
    # Blocks for everyone, slots for two: the urgent request must not wait for a batch request to finish.
    scheduler = Scheduler(SchedulerConfig(2, 64), BlockAllocator(200, BLOCK_SIZE), S3Policy(bucket_tokens=16))
    batch = [request("batch0", 150, priority=5), request("batch1", 150, priority=5)]
    for seq in batch:
        scheduler.add(seq)
    step(scheduler)
    urgent = request("urgent", 4, priority=0)
    scheduler.add(urgent)
    step(scheduler)
    assert urgent.status is SequenceStatus.RUNNING and len(scheduler.running) == 2
    assert sum(seq.num_preemptions for seq in batch) == 1
    # The same class does not: a second batch request waits for a slot.
    late = request("batch2", 4, priority=5)
    scheduler.add(late)
    step(scheduler)
    assert late.status is SequenceStatus.WAITING and sum(seq.num_preemptions for seq in batch) == 1


def test_a_negative_guard_is_refused():
    with pytest.raises(ValueError, match="max_overtaken_steps must be >= 0"):
        SchedulerConfig(4, 64, -1)


@pytest.mark.parametrize("bound_s", [-1.0, float("inf"), float("nan")])
def test_a_starvation_bound_that_is_negative_or_not_finite_is_refused(bound_s):
    # an infinite bound would age nobody: s3_peak's order would silently become arrival order
    with pytest.raises(ValueError, match="max_queue_wait_s must be finite and >= 0"):
        SchedulerConfig(4, 64, max_queue_wait_s=bound_s)
    with pytest.raises(ValueError, match="max_queue_wait_s must be finite and >= 0"):
        S3PeakPolicy().set_max_queue_wait(bound_s)
