"""s3_peak on synthetic requests: admission by the future peak, its order, its victims."""

import pytest

from policy_driver import BLOCK_SIZE, MAX_LEN, make_requests, simulate, waiting_seq
from workers.actors.worker_settings import WorkerSettings
from workers.scheduling.kv_cache_manager import BlockAllocator
from workers.scheduling.policies import overcommit_options
from workers.scheduling.s3_peak import S3PeakPolicy
from workers.scheduling.s3_policy import S3Policy
from workers.scheduling.scheduler import Scheduler, SchedulerConfig
from workers.values.sampling_params import SamplingParams
from workers.values.sequence import Sequence, SequenceStatus


def _mean(values: list[int]) -> float:
    return sum(values) / len(values)


def test_s3_peak_with_exact_predictions_never_preempts_and_packs_more_than_s3():
    num_blocks = 3 * MAX_LEN // BLOCK_SIZE
    peak, allocator, peak_running, _ = simulate(S3PeakPolicy(bucket_tokens=25, overcommit_step=0.0),
                                                make_requests(60, 6), num_blocks)
    _, _, s3_running, _ = simulate(S3Policy(bucket_tokens=25), make_requests(60, 6), num_blocks)
    assert peak.stats.num_preemptions == 0  # the peak checked against the pool itself
    # Shortest-first admission leaves the longest requests for the end, where few run beside them.
    assert _mean(peak_running) > 1.1 * _mean(s3_running)
    assert allocator.num_free_blocks == allocator.num_blocks


def test_s3_peak_stretches_its_budget_while_it_refuses_and_halves_it_after_a_preemption():
    policy = S3PeakPolicy(overcommit_step=0.25, max_overcommit=0.6)
    # Blocks of 16 tokens. Running: 20 tokens held of 110 planned (7 blocks at its end, in 90 steps). Waiting:
    # 70 planned (5 blocks at its end, in 60 steps, when the running one holds 80 tokens: 5 blocks).
    held = waiting_seq("held", arrival_s=0.0, predicted=100, decoded=10)
    newcomer = waiting_seq("new", arrival_s=1.0, predicted=60)

    def admits() -> bool:
        return policy.can_admit(newcomer, [held], num_blocks=8, block_size=16, step_token_budget=64)

    assert not admits()  # together they would hold 10 blocks of 8 in 60 steps
    assert not admits()  # asking twice changes nothing: the scheduler reports a real refusal
    policy.on_refused(newcomer, [held])
    policy.on_step([held])
    assert policy.overcommit == 0.25 and admits()  # 8 x 1.25 = 10 blocks
    for _ in range(3):
        policy.on_step([held])
    assert policy.overcommit == 0.25  # no refusal since: nothing to stretch for
    for _ in range(2):  # 210 planned tokens: 14 blocks, refused each step
        big = waiting_seq("big", 2.0, predicted=200)
        assert not policy.can_admit(big, [held], 8, 16, 64)
        policy.on_refused(big, [held])
        policy.on_step([held])
    assert policy.overcommit == 0.6  # capped at max_overcommit
    policy.on_preempted(held, [held])
    policy.on_step([held])
    assert policy.overcommit == 0.3  # a sequence could not grow: half the stretch
    big = waiting_seq("big", 2.0, predicted=200)
    assert not policy.can_admit(big, [], 8, 16, 64)
    policy.on_refused(big, [])
    policy.on_step([])
    assert policy.overcommit == 0.3  # refused with nothing running: no stretch, and none given back while idle
    for options in ({"overcommit_step": -0.1}, {"max_overcommit": -1.0}):
        with pytest.raises(ValueError, match="overcommit"):
            S3PeakPolicy(**options)


def test_s3_peak_overcommit_runs_more_at_once_and_every_request_still_finishes():
    num_blocks = 3 * MAX_LEN // BLOCK_SIZE
    strict, _, strict_running, _ = simulate(S3PeakPolicy(bucket_tokens=25, overcommit_step=0.0),
                                            make_requests(60, 6), num_blocks)
    stretched, allocator, stretched_running, _ = simulate(S3PeakPolicy(bucket_tokens=25), make_requests(60, 6),
                                                          num_blocks)
    # Exact plans still peak below the pool most of the time: running beyond them fills the KV, at the cost of
    # the preemptions that mark where the stretch stops.
    assert _mean(stretched_running) > 1.1 * _mean(strict_running)
    assert stretched.stats.num_preemptions > 0 and len(stretched_running) < len(strict_running)
    assert allocator.num_free_blocks == allocator.num_blocks


def test_s3_peak_does_not_stretch_where_victims_are_only_recomputed():
    assert overcommit_options("s3_peak", None, can_swap=False) == {"overcommit_step": 0.0, "shorter_work_ratio": 0.0}
    assert overcommit_options("s3_peak", None, can_swap=True) == {}  # the policy's own default
    assert overcommit_options("s3_peak", 0.05, can_swap=False) == {"overcommit_step": 0.05,  # a set one wins
                                                                  "shorter_work_ratio": 0.0}
    assert overcommit_options("paged_greedy", None, can_swap=False) == {}
    # The worker reads its own preemption settings: recompute, or no host room to swap into.
    for changes, step in (({}, 0.01), ({"preemption_mode": "recompute"}, 0.0), ({"swap_space_bytes": 0}, 0.0),
                          ({"preemption_mode": "recompute", "overcommit_step": 0.02}, 0.02)):
        assert WorkerSettings.of(**changes).make_policy().overcommit_step == step, changes


RUNNING = [waiting_seq("running", arrival_s=0.0, predicted=50, decoded=5)]  # something holds blocks


def _kv_scarce(policy: S3PeakPolicy) -> S3PeakPolicy:
    """`policy` after its peak test refused a request in the last step."""
    huge = waiting_seq("huge", arrival_s=0.0, predicted=10_000)
    assert not policy.can_admit(huge, RUNNING, num_blocks=4, block_size=16, step_token_budget=64)
    policy.on_refused(huge, RUNNING)
    policy.on_step(RUNNING)
    return policy


def test_s3_peak_admits_the_shortest_predicted_remaining_first_and_ages_the_long_ones():
    policy = S3PeakPolicy(length_range_tokens=500)  # the scheduler's bound: 30 s until one hands over another
    long_old = waiting_seq("long_old", arrival_s=0.0, predicted=400)
    short_new = waiting_seq("short_new", arrival_s=5.0, predicted=20)
    mostly_done = waiting_seq("mostly_done", arrival_s=8.0, predicted=40, decoded=36)  # a few to go (preempted)
    # the key: arrival + 30 s x expected remaining / 500 tokens; nothing is KV-scarce, nobody refused: the order holds
    # whenever a queue forms, whatever holds it back
    assert not policy.kv_scarce
    assert [s.seq_id for s in policy.admission_order([long_old, short_new, mostly_done])] == [
        "short_new", "mostly_done", "long_old"]
    assert 0 < policy.order_key(long_old) - long_old.arrival_s <= 30.0
    # Only requests that arrived within 30 s of it can pass it: one arriving later goes after it, however short.
    short_late = waiting_seq("short_late", arrival_s=30.5, predicted=1)
    assert [s.seq_id for s in policy.admission_order([short_late, long_old])] == ["long_old", "short_late"]
    # At a 0 s bound it is first come first served.
    policy.set_max_queue_wait(0.0)
    assert [s.seq_id for s in policy.admission_order([long_old, short_new])] == ["long_old", "short_new"]
    with pytest.raises(ValueError, match="max_queue_wait_s"):
        policy.set_max_queue_wait(-1.0)
    for options in ({"length_range_tokens": 0}, {"order_by_work": "never"}):
        with pytest.raises(ValueError, match=next(iter(options))):
            S3PeakPolicy(**options)


def test_the_service_bound_and_length_range_reach_the_policy():
    settings = WorkerSettings.of(max_queue_wait_s=12.0, max_model_len=1024)
    policy = settings.make_policy()
    assert policy.length_range_tokens == 1024
    Scheduler(settings.engine.scheduler, BlockAllocator(8, 4), policy)  # as the engine builds its own
    assert policy.max_queue_wait_s == 12.0
    assert WorkerSettings.of(max_model_len=8192).make_policy().length_range_tokens == 2048  # the buckets' range


def test_s3_peak_as_it_was_takes_its_queue_in_order_until_kv_runs_short_and_for_a_window_after():
    policy = S3PeakPolicy(pressure_window_steps=3, order_by_work="kv_scarce")
    long_old = waiting_seq("long_old", arrival_s=0.0, predicted=400)
    short_new = waiting_seq("short_new", arrival_s=1.0, predicted=100)
    queue, shortest_first = [long_old, short_new], ["short_new", "long_old"]
    fits = waiting_seq("fits", arrival_s=0.0, predicted=10)
    assert policy.can_admit(fits, RUNNING, num_blocks=40, block_size=16, step_token_budget=64)
    policy.on_step(RUNNING)
    assert not policy.kv_scarce and policy.admission_order(queue) == queue  # room for all: as paging admits

    def orders(num_steps: int) -> list[list[str]]:
        seen = []
        for _ in range(num_steps):
            seen.append([s.seq_id for s in policy.admission_order(queue)])
            policy.on_step(RUNNING)
        return seen

    _kv_scarce(policy)  # refused in the last step: shortest first for the window's 3 steps, then in order
    assert orders(4) == [shortest_first] * 3 + [["long_old", "short_new"]]
    policy.on_preempted(RUNNING[0], [])  # a sequence could not grow: as scarce as a refusal
    policy.on_step(RUNNING)
    assert orders(1) == [shortest_first]
    policy.on_step([])  # nothing runs: every block is free, whatever happened before
    assert not policy.kv_scarce and policy.admission_order(queue) == queue
    with pytest.raises(ValueError, match="pressure_window_steps"):
        S3PeakPolicy(pressure_window_steps=0)


def test_s3_peak_preempts_the_sequence_predicted_to_hold_its_blocks_longest():
    policy = S3PeakPolicy()
    near_end = waiting_seq("near_end", 0.0, predicted=300, decoded=290)
    long_left = waiting_seq("long_left", 1.0, predicted=300, decoded=20)
    grower = waiting_seq("grower", 2.0, predicted=50, decoded=40)
    assert policy.choose_victim(grower, [near_end, long_left, grower]) is long_left
    # Equal remaining: the one with less KV computed is cheaper to redo.
    twin = waiting_seq("twin", 3.0, predicted=300, decoded=20)
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
    long = waiting_seq("long", 0.0, predicted=12)
    short = waiting_seq("short", 10.0, predicted=3)
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


class _AlwaysAsked(S3PeakPolicy):
    """s3_peak whose refusals tell the scheduler nothing: it asks the peak test about every candidate."""

    questions = 0

    def refused_too(self, plan, refused_plan):
        return False

    def can_admit(self, *args):
        type(self).questions += 1
        return super().can_admit(*args)


class _Counted(S3PeakPolicy):
    questions = 0

    def can_admit(self, *args):
        type(self).questions += 1
        return super().can_admit(*args)


@pytest.mark.parametrize("error", [0.0, -0.5, 0.4])
def test_s3_peak_refusals_skip_questions_the_scheduler_knows_the_answer_to_and_change_no_decision(error):
    # A long queue and little KV: each step tries most of the queue (first fit), nearly all refused.
    runs = []
    for policy in (_AlwaysAsked(bucket_tokens=25), _Counted(bucket_tokens=25)):
        seqs = make_requests(60, seed=11, prediction_error=error)
        scheduler, _, running_counts, _ = simulate(policy, seqs, num_blocks=40)
        runs.append((running_counts, scheduler.stats.num_preemptions, [s.num_output_tokens for s in seqs],
                     type(policy).questions))
    (counts_asked, preempted_asked, outputs_asked, asked), (counts, preempted, outputs, skipped) = runs
    assert (counts, preempted, outputs) == (counts_asked, preempted_asked, outputs_asked)  # the same schedule
    assert skipped < asked / 2, (skipped, asked)  # 35-38% of the questions here


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


def test_s3_peak_ranks_an_overrun_around_its_prediction_not_around_the_bound_the_overrun_raised():
    policy = S3PeakPolicy(bucket_tokens=100)
    seq = waiting_seq("over", 0.0, predicted=50, decoded=60)
    seq.predicted_center_tokens = 50  # as the engine sets it from the prediction
    before = policy.remaining_tokens(seq)
    assert policy.bound_after_overrun(seq) == 100  # 60 decoded past a bound of 50: the plan moves to the next bucket
    seq.predicted_output_tokens = 100  # as the scheduler writes it
    assert policy.remaining_tokens(seq) == before == policy.lengths.remaining_of(50, 60, 500)
    seq.is_looping = True  # once it repeats itself it is expected to run to its limit
    assert policy.remaining_tokens(seq) == 500 - 60
