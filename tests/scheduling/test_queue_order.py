"""A worker's queue ordered by predicted work whenever it forms, the starvation bound in seconds, and preemption for
shorter work: the scheduler on a simulated clock, and the engine on the tiny model."""

import copy
import time

import pytest

from engine_driver import BLOCK_SIZE, BYTES_PER_BLOCK, greedy, make_model, make_prompt
from policy_driver import run_step
from workers.engine.engine import Engine, EngineConfig
from workers.scheduling.kv_cache_manager import BlockAllocator
from workers.scheduling.policies import PagedGreedyPolicy
from workers.scheduling.s3_peak import S3PeakPolicy
from workers.scheduling.preemption import PreemptionRule
from workers.scheduling.scheduler import Scheduler, SchedulerConfig
from workers.scheduling.scheduling_policy import SchedulingPolicy
from workers.values.sampling_params import SamplingParams
from workers.values.sequence import Sequence

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model():
    return make_model(seed=3)


def _engine(model, policy: SchedulingPolicy, max_num_seqs: int, num_blocks: int = 64) -> Engine:
    config = EngineConfig.of(kv_cache_bytes=num_blocks * BYTES_PER_BLOCK, block_size=BLOCK_SIZE,
                             max_num_seqs=max_num_seqs, max_num_batched_tokens=64, preemption_mode="swap")
    return Engine(copy.deepcopy(model), config, policy=policy)


def _finish_order(engine: Engine, arrivals: dict[int, list[tuple[str, int, int]]]) -> tuple[list[str], dict]:
    """Add (id, forced output tokens = predicted) requests at their steps, 10 ms apart on the arrival clock; run
    to the end. Returns the ids in the order they finished and each one's output tokens."""
    finished, outputs = [], {}
    step, start_s = 0, time.monotonic()  # the engine's clock
    while step <= max(arrivals) or engine.has_unfinished():
        assert step < 2000, "the engine stopped making progress"
        for seq_id, num_output, seed in arrivals.get(step, []):
            engine.add_request(make_prompt(8, seed), greedy(num_output, forced_output_tokens=num_output),
                               seq_id=seq_id, predicted_output_tokens=num_output, arrival_s=start_s + step * 0.01)
        for out in engine.step():
            if out.is_finished:
                finished.append(out.seq_id)
                outputs[out.seq_id] = list(out.output_token_ids)
        step += 1
    return finished, outputs


ARRIVALS = {0: [("running", 12, 0)], 1: [("long_a", 40, 1), ("long_b", 40, 2)], 2: [("short", 3, 3)]}


def test_a_short_request_overtakes_queued_long_ones_when_slots_bind(model):
    # one slot: the running one holds it, two long answers wait, then a short one arrives
    policy = S3PeakPolicy(shorter_work_ratio=0.0)  # the order alone (preemption for shorter work: below)
    order, _ = _finish_order(_engine(model, policy, max_num_seqs=1), ARRIVALS)
    assert order == ["running", "short", "long_a", "long_b"]
    paged, _ = _finish_order(_engine(model, PagedGreedyPolicy(), max_num_seqs=1), ARRIVALS)
    assert paged == ["running", "long_a", "long_b", "short"]  # first come, first served
    # ordered only while KV is scarce (s3_peak before), it served this queue first come, first served: KV never ran
    # short, the slot held the queue back
    scarce_only = S3PeakPolicy(shorter_work_ratio=0.0, order_by_work="kv_scarce")
    order, _ = _finish_order(_engine(model, scarce_only, max_num_seqs=1), ARRIVALS)
    assert order == paged


class _NewestFirst(SchedulingPolicy):
    """Paging that admits the newest waiting request first: a policy that would starve the oldest for ever."""

    name = "newest_first"
    holds_plan = False

    def planned_output_tokens(self, num_output_tokens, max_tokens, predicted_output_tokens, forced=None):
        return num_output_tokens

    def admission_order(self, waiting):
        return sorted(waiting, key=lambda s: -s.arrival_s)


def _seq(seq_id: str, arrival_s: float, num_output: int) -> Sequence:
    return Sequence(seq_id, list(range(4)), SamplingParams(max_tokens=200, ignore_eos=True,
                                                           forced_output_tokens=num_output),
                    arrival_s=arrival_s, predicted_output_tokens=num_output, predicted_center_tokens=num_output)


def _admitted_at(policy: SchedulingPolicy, max_queue_wait_s: float, num_steps: int = 120) -> float | None:
    """One slot, one step a simulated second; a 30-token request arrives at t=0 behind a running 2-token one, then a
    2-token one arrives every second. When (simulated s) the long one starts, or None if it never does."""
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64,
                                          max_queue_wait_s=max_queue_wait_s),
                          BlockAllocator(1024, 4), policy, PreemptionRule("swap", 1024))
    scheduler.add(_seq("first", -0.5, 2))
    scheduler.add(_seq("long", 0.0, 30))
    for now_s in range(num_steps):
        scheduler.add(_seq(f"short{now_s}", now_s + 0.5, 2))
        out = scheduler.schedule(float(now_s + 1))
        if any(chunk.seq.seq_id == "long" for chunk in out.chunks):
            return float(now_s + 1)
        run_step(scheduler, out)
    return None


@pytest.mark.parametrize("bound_s", [5.0, 20.0])
def test_a_long_request_starts_within_the_starvation_bound_while_short_ones_keep_arriving(bound_s):
    # shorts arrive faster than one slot serves them, so the queue of shorter work never empties
    # (lengths aged over a 40-token range: the long one is three fourths of it, each short one a twentieth)
    policy = S3PeakPolicy(length_range_tokens=40, shorter_work_ratio=0.0)  # its scheduler hands it the bound
    started = _admitted_at(policy, bound_s)
    assert started is not None and bound_s / 2 <= started <= bound_s + 3  # shorter work first, until the bound
    # The bound is the scheduler's, whatever the policy's order: one that always takes the newest still lets the
    # long one in once it has waited that long.
    started = _admitted_at(_NewestFirst(), bound_s)
    assert started is not None and bound_s <= started <= bound_s + 3
    # Without it (a bound longer than the run), shortest first never gets to the long one.
    assert _admitted_at(S3PeakPolicy(length_range_tokens=40, shorter_work_ratio=0.0), 1e6) is None


def test_preemption_for_shorter_work_swaps_the_longest_expected_protects_one_near_its_end_and_loses_no_token(model):
    policy = S3PeakPolicy()
    engine = _engine(model, policy, max_num_seqs=2)
    requests = {"long": (40, 11), "near_end": (16, 12), "short": (3, 13)}  # id: (output tokens, prompt seed)
    for seq_id in ("long", "near_end"):
        num_output, seed = requests[seq_id]
        engine.add_request(make_prompt(8, seed), greedy(num_output, forced_output_tokens=num_output), seq_id=seq_id,
                           predicted_output_tokens=num_output)
    outputs = {}
    running = {s.seq_id: s for s in engine.scheduler.running}
    while not running or not policy.is_protected(running["near_end"]):
        engine.step()
        running = {s.seq_id: s for s in engine.scheduler.running}
    assert not policy.is_protected(running["long"])
    num_output, seed = requests["short"]
    engine.add_request(make_prompt(8, seed), greedy(num_output, forced_output_tokens=num_output), seq_id="short",
                       predicted_output_tokens=num_output)
    engine.step()  # both slots are taken: the longest expected one gives up its own for the short one
    assert {s.seq_id for s in engine.scheduler.running} == {"near_end", "short"}
    stats = engine.scheduler.stats
    assert stats.preemptions_by_cause == {"kv": 0, "priority": 0, "shorter_work": 1} and stats.num_swaps == 1
    finished = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.is_finished:
                finished.append(out.seq_id)
                outputs[out.seq_id] = list(out.output_token_ids)
    assert finished.index("short") < finished.index("long")
    assert stats.preemptions_by_cause["shorter_work"] == 1  # preempted once, the long one is never again
    for seq_id, (num_output, seed) in requests.items():  # each answer is the one it gives alone
        alone = _engine(model, S3PeakPolicy(), max_num_seqs=1)
        alone.add_request(make_prompt(8, seed), greedy(num_output, forced_output_tokens=num_output), seq_id=seq_id,
                          predicted_output_tokens=num_output)
        tokens = []
        while alone.has_unfinished():
            tokens += [out.token_id for out in alone.step()]
        assert outputs[seq_id] == tokens, seq_id


def test_shorter_work_preemption_is_bounded_in_rate_and_needs_work_far_shorter():
    policy = S3PeakPolicy(shorter_work_ratio=4.0, shorter_work_gap_steps=3)
    long_one = _seq("long", 0.0, 150)
    long_one.output_token_ids = [7] * 10
    short = _seq("short", 1.0, 5)
    assert policy.shorter_work_victim(short, [long_one]) is long_one
    assert policy.shorter_work_victim(_seq("medium", 1.0, 120), [long_one]) is None  # not 4x shorter
    policy.on_preempted_for(long_one, short)
    other = _seq("other", 0.0, 150)
    assert policy.shorter_work_victim(short, [other]) is None  # one every 3 steps
    for _ in range(3):
        policy.on_step([])
    assert policy.shorter_work_victim(short, [other]) is other
    other.num_preemptions = 1
    assert policy.shorter_work_victim(short, [other]) is None  # preempted before: protected
    assert S3PeakPolicy(shorter_work_ratio=0.0).shorter_work_victim(short, [long_one]) is None
    with pytest.raises(ValueError, match="shorter_work"):
        S3PeakPolicy(shorter_work_gap_steps=0)


def _step(scheduler: Scheduler, now_s: float) -> list[str]:
    """One step at `now_s`: the ids it ran (the engine's part done, as `run_step` does it)."""
    out = scheduler.schedule(now_s)
    ran = [chunk.seq.seq_id for chunk in out.chunks]
    run_step(scheduler, out)
    return ran


def test_a_request_let_in_this_step_is_not_preempted_for_shorter_work_in_the_same_step():
    # Two slots: a protected one near its end holds one. The long request that has waited out the 30 s bound
    # takes the other; the short one behind it then finds no slot, and the only unprotected running one is the
    # request just let in: it stays.
    policy = S3PeakPolicy()
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64), BlockAllocator(1024, 4),
                          policy, PreemptionRule("swap", 1024))
    near_end = _seq("near_end", 0.0, 190)
    near_end.predicted_center_tokens = 100  # predicted 100, it has run past half its expected length
    scheduler.add(near_end)
    now_s = 0
    while now_s < 36 or not policy.is_protected(near_end):
        _step(scheduler, float(now_s))
        now_s += 1
    assert near_end.num_preemptions == 0 and near_end.num_output_tokens < 190
    scheduler.add(_seq("long", 1.0, 180))
    scheduler.add(_seq("short", now_s - 0.5, 2))
    assert _step(scheduler, float(now_s)) == ["near_end", "long"]  # waited over 30 s: ahead of the shorter work
    assert scheduler.stats.preemptions_by_cause["shorter_work"] == 0
    assert [s.seq_id for s in scheduler.waiting] == ["short"]


def test_the_starvation_bound_counts_the_wait_since_a_request_last_joined_the_queue():
    # One slot, newest first. "old" runs from t=1 until a more urgent request takes its slot at t=40; "newer" has
    # waited since t=35. Back in the queue, "old" has waited 2 s, not 42: the newest-first order holds.
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, max_queue_wait_s=30.0),
                          BlockAllocator(1024, 4), _NewestFirst(), PreemptionRule("swap", 1024))
    scheduler.add(_seq("old", 0.0, 100))
    for now_s in range(1, 40):
        if now_s == 35:
            scheduler.add(_seq("newer", 35.0, 5))
        assert _step(scheduler, float(now_s)) == ["old"]
    urgent = _seq("urgent", 40.0, 2)
    urgent.priority = -1
    scheduler.add(urgent)
    assert _step(scheduler, 40.0) == ["urgent"] and scheduler.stats.preemptions_by_cause["priority"] == 1
    assert _step(scheduler, 41.0) == ["urgent"]  # its second token: done
    assert _step(scheduler, 42.0) == ["newer"]  # not "old", whose 42 s since arrival include 39 s of running


class _OfferedVictims(PagedGreedyPolicy):
    """Paging that records whom the scheduler offers it to preempt for shorter work, and preempts nobody."""

    def __init__(self):
        super().__init__()
        self.offered: list[list[str]] = []

    def shorter_work_victim(self, seq, running):
        self.offered.append(sorted(s.seq_id for s in running))
        return None


def test_shorter_work_victims_come_from_the_least_urgent_class_running():
    # 8 blocks of 4 tokens: "same" (class 0) holds 5, "lower" (class 1) 1; "waiting" (class 0) needs 4. Preempting
    # "lower" would not make room, and "same" is not offered while a less urgent class runs.
    policy = _OfferedVictims()
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=64), BlockAllocator(8, 4), policy,
                          PreemptionRule("swap", 1024))
    for seq_id, prompt_tokens, priority in (("same", 20, 0), ("lower", 4, 1)):
        scheduler.add(Sequence(seq_id, list(range(prompt_tokens)), SamplingParams(max_tokens=50, ignore_eos=True),
                               priority=priority, predicted_output_tokens=50))
    run_step(scheduler, scheduler.schedule(0.0))
    scheduler.add(Sequence("waiting", list(range(16)), SamplingParams(max_tokens=2, ignore_eos=True),
                           arrival_s=1.0, predicted_output_tokens=2))
    out = scheduler.schedule(1.0)
    assert policy.offered == [["lower"]]
    assert {chunk.seq.seq_id for chunk in out.chunks} == {"same", "lower"}  # nobody preempted, "waiting" waits


def _victim_back_and_newcomer_start(preempted_first: bool) -> tuple[float, float]:
    """Two requests predicted at 4 tokens run to 40 in 14 blocks of 4 tokens, so one is preempted (swapped) for KV;
    a 2-token request arrives just after. When (simulated s) the preempted one runs again, and when the newcomer
    starts."""
    policy = S3PeakPolicy(shorter_work_ratio=0.0)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, preempted_first=preempted_first),
                          BlockAllocator(14, 4), policy, PreemptionRule("swap", 1024))
    for seq_id in ("a", "b"):  # max_tokens 48: a whole plan fits the empty pool, as max_model_len sees to
        scheduler.add(Sequence(seq_id, list(range(4)), SamplingParams(max_tokens=48, ignore_eos=True,
                                                                      forced_output_tokens=40),
                               arrival_s=0.0, predicted_output_tokens=4, predicted_center_tokens=4))
    now_s = 1.0
    while scheduler.stats.preemptions_by_cause["kv"] == 0:
        _step(scheduler, now_s)
        now_s += 1
    (victim,) = scheduler.waiting
    scheduler.add(_seq("short", now_s - 0.5, 2))
    started: dict[str, float] = {}
    while scheduler.running or scheduler.waiting:
        assert now_s < 200, "the scheduler stopped making progress"
        for seq_id in _step(scheduler, now_s):
            started.setdefault(seq_id, now_s)
        now_s += 1
    return started[victim.seq_id], started["short"]


def test_a_sequence_preempted_for_kv_goes_back_before_newer_requests_pass_it():
    back_s, short_s = _victim_back_and_newcomer_start(preempted_first=True)
    assert back_s <= short_s  # nobody took the blocks it freed while it waited to come back
    # Off (s3_peak's first fit as before 2026-12-02): the newer, smaller request starts in the blocks the victim
    # freed while the victim, whose whole context must come back, waits for the other one to finish.
    back_s, short_s = _victim_back_and_newcomer_start(preempted_first=False)
    assert short_s < back_s
