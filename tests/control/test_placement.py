"""Cluster placement policy: FFD packing, starvation guard, migration targets, pool scaling."""

import dataclasses
import random

import pytest

from cluster.control.placement import (PendingRequest, RoomIndex, WorkerBudget, blocks_for, first_fit_decreasing,
                                       longest_cached_prefix, migration_target, open_slots, prefix_affinity,
                                       roomiest_fit)
from cluster.control.scaling import ScalingPolicy


def make_workers(*free_blocks: int, total: int = 100) -> list[WorkerBudget]:
    """Workers w0, w1, ... with `total` blocks each and the given free blocks."""
    return [WorkerBudget(f"w{i}", total, total - free) for i, free in enumerate(free_blocks)]


def make_requests(*num_blocks: int, arrival_s: float = 0.0) -> list[PendingRequest]:
    """Requests r0, r1, ... arriving one second apart from `arrival_s`."""
    return [PendingRequest(f"r{i}", n, arrival_s + i) for i, n in enumerate(num_blocks)]


def test_blocks_for_rounds_up_and_rejects_bad_input():
    assert blocks_for(0, 16) == 0
    assert blocks_for(1, 16) == 1
    assert blocks_for(16, 16) == 1
    assert blocks_for(17, 16) == 2
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        blocks_for(10, 0)
    with pytest.raises(ValueError, match="num_tokens must be >= 0, got -1"):
        blocks_for(-1, 16)


def test_worker_budget_free_blocks_never_negative_and_validated():
    assert WorkerBudget("w", 10, 3).num_free_blocks == 7
    assert WorkerBudget("w", 10, 15).num_free_blocks == 0
    with pytest.raises(ValueError, match="num_total_blocks must be >= 0, got -1"):
        WorkerBudget("w", -1, 0)
    with pytest.raises(ValueError, match="num_reserved_blocks must be >= 0, got -2"):
        WorkerBudget("w", 10, -2)
    with pytest.raises(ValueError, match="num_blocks must be >= 1, got 0"):
        PendingRequest("r", 0, 0.0)


def test_largest_request_is_placed_first():
    # One worker with 10 free: FFD takes the 8 (largest) and then the 2 that still fits; the 5 waits.
    placements = first_fit_decreasing(make_requests(5, 8, 2), make_workers(10))
    assert placements == {"r1": "w0", "r2": "w0"}


def test_a_more_urgent_class_is_placed_before_larger_or_older_requests():
    requests = [PendingRequest("big", 8, 1.0), PendingRequest("urgent", 4, 9.0, priority=-1),
                PendingRequest("batch", 2, 0.0, priority=5)]
    # 10 free: the urgent 4 first, then the 8 no longer fits, the batch 2 does.
    assert first_fit_decreasing(requests, make_workers(10)) == {"urgent": "w0", "batch": "w0"}
    starved = [PendingRequest("old-batch", 6, 0.0, priority=5), PendingRequest("old-urgent", 6, 1.0)]
    assert first_fit_decreasing(starved, make_workers(6), now_s=100.0) == {"old-urgent": "w0"}


def test_ties_in_size_go_to_the_earliest_arrival():
    requests = [PendingRequest("late", 6, 10.0), PendingRequest("early", 6, 1.0)]
    assert first_fit_decreasing(requests, make_workers(6)) == {"early": "w0"}


def test_workers_are_tried_most_free_first_with_ties_by_id():
    workers = [WorkerBudget("b", 100, 50), WorkerBudget("a", 100, 50), WorkerBudget("c", 100, 20)]
    assert first_fit_decreasing(make_requests(10), workers) == {"r0": "c"}
    even = [WorkerBudget("b", 100, 0), WorkerBudget("a", 100, 0)]
    assert first_fit_decreasing(make_requests(10), even) == {"r0": "a"}


def test_reservations_accumulate_within_one_call():
    # 30 + 30 + 30 + 20 over workers with 60 and 50 free: w0 takes two 30s, w1 a 30 and the 20.
    placements = first_fit_decreasing(make_requests(30, 30, 30, 20), make_workers(60, 50))
    assert placements == {"r0": "w0", "r1": "w0", "r2": "w1", "r3": "w1"}


def test_requests_that_fit_nowhere_are_left_out():
    placements = first_fit_decreasing(make_requests(200, 5), make_workers(50, 40))
    assert placements == {"r1": "w0"}


def test_workers_not_ready_take_nothing():
    workers = [WorkerBudget("w0", 100, 0, is_ready=False), WorkerBudget("w1", 100, 90)]
    assert first_fit_decreasing(make_requests(20, 5), workers) == {"r1": "w1"}


def test_overcommitted_worker_takes_nothing():
    workers = [WorkerBudget("w0", 10, 14)]
    assert first_fit_decreasing(make_requests(1), workers) == {}


def test_duplicate_ids_are_rejected():
    with pytest.raises(ValueError, match=r"duplicate request_ids: \['r'\]"):
        first_fit_decreasing([PendingRequest("r", 1, 0.0), PendingRequest("r", 2, 1.0)], make_workers(10))
    with pytest.raises(ValueError, match=r"duplicate worker_ids: \['w'\]"):
        first_fit_decreasing(make_requests(1), [WorkerBudget("w", 10, 0), WorkerBudget("w", 10, 0)])
    with pytest.raises(ValueError, match="max_wait_s must be >= 0, got -1"):
        first_fit_decreasing(make_requests(1), make_workers(10), now_s=0.0, max_wait_s=-1)


def test_starved_request_goes_before_larger_newer_ones():
    # Without the guard the 8 (newer, larger) goes first and the old 5 no longer fits.
    old = PendingRequest("old", 5, 0.0)
    new = PendingRequest("new", 8, 9.0)
    assert first_fit_decreasing([old, new], make_workers(10)) == {"new": "w0"}
    assert first_fit_decreasing([old, new], make_workers(10), now_s=10.0, max_wait_s=5.0) == {"old": "w0"}
    # Below the wait limit, plain FFD order applies.
    assert first_fit_decreasing([old, new], make_workers(10), now_s=4.0, max_wait_s=5.0) == {"new": "w0"}


def test_requests_ranked_by_predicted_work_go_shortest_first_until_one_starves():
    # Three requests wait for one 6-block gap. With work_tokens (an s3_peak worker admits by its own test, so
    # blocks say nothing of how long a request runs) the queue goes shortest predicted work first.
    requests = [PendingRequest("long", 6, 0.0, work_tokens=480.0), PendingRequest("short", 2, 1.0, work_tokens=12.0),
                PendingRequest("mid", 4, 2.0, work_tokens=90.0)]
    assert first_fit_decreasing(requests, make_workers(6), now_s=3.0, max_wait_s=30.0) == {"short": "w0", "mid": "w0"}
    # The long one has waited the bound: it goes first, and nobody newer passes it.
    assert first_fit_decreasing(requests, make_workers(6), now_s=30.0, max_wait_s=30.0) == {"long": "w0"}
    # Without work_tokens the same queue is largest reservation first.
    plain = [dataclasses.replace(r, work_tokens=None) for r in requests]
    assert first_fit_decreasing(plain, make_workers(6), now_s=3.0, max_wait_s=30.0) == {"long": "w0"}


def test_a_worker_is_sent_its_free_slots_while_nothing_waits_there_then_only_what_it_runs_plus_its_queue():
    # max_num_seqs 8, a worker queue of 2: an idle worker (nothing waiting) takes 8 + 2.
    assert open_slots(8, 2, num_running=0, num_waiting=0, num_placed=0) == 10
    assert open_slots(8, 2, num_running=3, num_waiting=0, num_placed=7) == 3
    # Something waits there (its KV test refused it): what it runs plus 2, less what it was sent already.
    assert open_slots(8, 2, num_running=3, num_waiting=1, num_placed=4) == 1
    assert open_slots(8, 2, num_running=3, num_waiting=2, num_placed=5) == 0
    assert open_slots(8, 2, num_running=3, num_waiting=4, num_placed=7) == 0  # never negative
    # Slots bind: it runs 8 and 2 wait; a release (placed 9) opens one place.
    assert open_slots(8, 2, num_running=8, num_waiting=2, num_placed=9) == 1
    assert open_slots(8, None, num_running=8, num_waiting=50, num_placed=58) is None  # late binding off


def test_open_slots_accumulate_within_one_call_and_the_rest_wait():
    workers = [dataclasses.replace(w, num_open_slots=n) for w, n in zip(make_workers(50, 50), (1, 2))]
    requests = make_requests(1, 1, 1, 1)
    placed = first_fit_decreasing(requests, workers)
    assert sorted(placed.values()) == ["w0", "w1", "w1"] and len(placed) == 3  # one left to wait


def test_a_chooser_picks_among_the_workers_that_fit_in_the_placement_order():
    seen = []

    def choose(request, fitting):
        seen.append((request.request_id, list(fitting)))
        return fitting[-1]

    workers = make_workers(3, 10, 6)
    placed = first_fit_decreasing(make_requests(5, 2), workers, choose=choose)
    # Most free first; after r0 took 5 of w2's 6 blocks, r1 (2 blocks) no longer fits there.
    assert seen == [("r0", ["w1", "w2"]), ("r1", ["w1", "w0"])]
    assert placed == {"r0": "w2", "r1": "w0"}


def test_first_come_requests_wait_in_order_of_arrival_whatever_their_size_or_work():
    requests = [PendingRequest("big", 6, 2.0, first_come=True), PendingRequest("small", 2, 1.0, first_come=True),
                PendingRequest("mid", 4, 0.0, work_tokens=5.0, first_come=True)]
    assert first_fit_decreasing(requests, make_workers(6)) == {"mid": "w0", "small": "w0"}


def test_starved_requests_among_themselves_go_oldest_first():
    requests = [PendingRequest("a", 4, 2.0), PendingRequest("b", 6, 1.0)]
    assert first_fit_decreasing(requests, make_workers(7), now_s=100.0) == {"b": "w0"}


def test_starved_request_that_does_not_fit_holds_a_worker_from_newer_requests():
    big = PendingRequest("big", 80, 0.0)
    smalls = [PendingRequest(f"s{i}", 10, 20.0 + i) for i in range(3)]
    workers = [WorkerBudget("w0", 100, 50), WorkerBudget("w1", 100, 60)]
    # Unguarded, the small ones take room on w0 (most free), and big keeps waiting behind them.
    assert first_fit_decreasing([big, *smalls], workers) == {"s0": "w0", "s1": "w0", "s2": "w0"}
    # Guarded, big holds w0 (most free, large enough): the small ones go to w1 only.
    guarded = first_fit_decreasing([big, *smalls], workers, now_s=21.0, max_wait_s=5.0)
    assert guarded == {"s0": "w1", "s1": "w1", "s2": "w1"}


def test_starved_request_larger_than_any_worker_holds_nothing():
    huge = PendingRequest("huge", 500, 0.0)
    placements = first_fit_decreasing([huge, *make_requests(10, arrival_s=50.0)], make_workers(50), now_s=60.0)
    assert placements == {"r0": "w0"}


def run_small_request_stream(max_wait_s: float, num_steps: int = 40) -> float | None:
    """One 40-block worker kept full by 5-block requests (two arrive each second, each runs 4 s);
    a 30-block request waits from t=0. Returns when it was placed, or None."""
    total = 40
    lifetime_s = 4.0
    running = {f"pre{k}": (5, 1.0 + k // 2) for k in range(8)}  # request_id -> (num_blocks, finish_s)
    waiting = [PendingRequest("big", 30, 0.0)]
    for step in range(num_steps):
        now_s = float(step)
        running = {rid: v for rid, v in running.items() if v[1] > now_s}
        waiting += [PendingRequest(f"s{step}-{k}", 5, now_s) for k in range(2)]
        reserved = sum(n for n, _ in running.values())
        placements = first_fit_decreasing(waiting, [WorkerBudget("w0", total, reserved)], now_s=now_s,
                                          max_wait_s=max_wait_s)
        for rid in placements:
            request = next(r for r in waiting if r.request_id == rid)
            running[rid] = (request.num_blocks, now_s + lifetime_s)
        waiting = [r for r in waiting if r.request_id not in placements]
        assert sum(n for n, _ in running.values()) <= total
        if "big" in placements:
            return now_s
    return None


def test_big_request_is_eventually_placed_under_a_stream_of_small_ones():
    # Without the guard, freed blocks go to the small newcomers every second and the big request never fits.
    assert run_small_request_stream(max_wait_s=1e9) is None
    placed_at_s = run_small_request_stream(max_wait_s=5.0)
    assert placed_at_s is not None and 5.0 <= placed_at_s <= 5.0 + 4.0


def test_no_worker_is_ever_overcommitted_randomized():
    rng = random.Random(1234)
    for _ in range(500):
        workers = [WorkerBudget(f"w{i}", rng.randint(0, 64), rng.randint(0, 80), is_ready=rng.random() > 0.2)
                   for i in range(rng.randint(0, 5))]
        pending = [PendingRequest(f"r{i}", rng.randint(1, 40), rng.uniform(0.0, 20.0))
                   for i in range(rng.randint(0, 30))]
        now_s = rng.choice([None, rng.uniform(0.0, 30.0)])
        placements = first_fit_decreasing(pending, workers, now_s=now_s, max_wait_s=rng.uniform(0.0, 10.0))
        by_id = {w.worker_id: w for w in workers}
        sizes = {r.request_id: r.num_blocks for r in pending}
        assert set(placements) <= set(sizes)
        for worker_id in set(placements.values()):
            worker = by_id[worker_id]
            assert worker.is_ready
            assert sum(sizes[r] for r, w in placements.items() if w == worker_id) <= worker.num_free_blocks
        if now_s is None:
            # Plain FFD is maximal: whatever was left out fits on no worker's remaining room.
            remaining = {w.worker_id: w.num_free_blocks for w in workers if w.is_ready}
            for request_id, worker_id in placements.items():
                remaining[worker_id] -= sizes[request_id]
            for request_id in set(sizes) - set(placements):
                assert all(sizes[request_id] > free for free in remaining.values())


def test_migration_target_is_the_roomiest_other_ready_worker():
    workers = [WorkerBudget("src", 100, 0), WorkerBudget("a", 100, 70), WorkerBudget("b", 100, 40),
               WorkerBudget("c", 100, 0, is_ready=False)]
    assert migration_target(20, workers, exclude_worker_id="src") == "b"
    assert migration_target(60, workers, exclude_worker_id="src") == "b"
    assert migration_target(61, workers, exclude_worker_id="src") is None
    assert migration_target(20, [WorkerBudget("src", 100, 0)], exclude_worker_id="src") is None
    ties = [WorkerBudget("y", 10, 0), WorkerBudget("x", 10, 0)]
    assert migration_target(5, ties, exclude_worker_id="src") == "x"
    with pytest.raises(ValueError, match="num_blocks must be >= 1, got 0"):
        migration_target(0, workers, exclude_worker_id="src")


def test_scaling_policy_validates_with_values():
    with pytest.raises(ValueError, match="min_workers must be >= 0, got -1"):
        ScalingPolicy(min_workers=-1, max_workers=2)
    with pytest.raises(ValueError, match=r"max_workers must be >= max\(1, min_workers=3\), got 2"):
        ScalingPolicy(min_workers=3, max_workers=2)
    with pytest.raises(ValueError, match="scale_up_queue_depth must be >= 1, got 0"):
        ScalingPolicy(min_workers=1, max_workers=2, scale_up_queue_depth=0)
    with pytest.raises(ValueError, match="scale_down_idle_s must be >= 0, got -1"):
        ScalingPolicy(min_workers=1, max_workers=2, scale_down_idle_s=-1)
    with pytest.raises(ValueError, match="max_scale_up_step must be >= 1, got 0"):
        ScalingPolicy(min_workers=1, max_workers=2, max_scale_up_step=0)
    policy = ScalingPolicy(min_workers=1, max_workers=2)
    with pytest.raises(ValueError, match="num_pending must be >= 0, got -3"):
        policy.desired_num_workers(1, -3, 0, 0, 10, 0.0)
    with pytest.raises(ValueError, match="blocks_per_worker must be >= 1, got 0"):
        policy.desired_num_workers(1, 0, 0, 0, 0, 0.0)


def decide(policy: ScalingPolicy, num_workers: int, num_pending: int = 0, num_pending_blocks: int = 0,
           num_free_blocks_total: int = 0, idle_s: float = 0.0) -> int:
    return policy.desired_num_workers(num_workers, num_pending, num_pending_blocks, num_free_blocks_total,
                                      blocks_per_worker=100, idle_s=idle_s)


def test_scales_up_on_queue_depth_one_step_at_a_time():
    policy = ScalingPolicy(min_workers=1, max_workers=8, scale_up_queue_depth=4)
    # 2 workers, 8 pending: exactly 4 per worker, not above it; plenty of free blocks.
    assert decide(policy, 2, num_pending=8, num_pending_blocks=10, num_free_blocks_total=150) == 2
    assert decide(policy, 2, num_pending=9, num_pending_blocks=10, num_free_blocks_total=150) == 3
    # Far more demand still adds one worker per decision by default, a bounded step when configured.
    assert decide(policy, 2, num_pending=100, num_free_blocks_total=150) == 3
    wide = ScalingPolicy(min_workers=1, max_workers=8, max_scale_up_step=3)
    assert decide(wide, 2, num_pending=100, num_free_blocks_total=150) == 5


def test_scales_up_when_predicted_blocks_exceed_free_room():
    policy = ScalingPolicy(min_workers=1, max_workers=8, scale_up_queue_depth=100)
    assert decide(policy, 2, num_pending=3, num_pending_blocks=40, num_free_blocks_total=40) == 2
    assert decide(policy, 2, num_pending=3, num_pending_blocks=41, num_free_blocks_total=40) == 3


def test_scale_up_is_clamped_to_max_workers():
    policy = ScalingPolicy(min_workers=1, max_workers=3, max_scale_up_step=5)
    assert decide(policy, 3, num_pending=100, num_pending_blocks=10_000) == 3
    assert decide(policy, 2, num_pending=100, num_pending_blocks=10_000) == 3


def test_empty_pool_with_demand_starts_a_worker():
    policy = ScalingPolicy(min_workers=0, max_workers=4)
    assert decide(policy, 0, num_pending=1, num_pending_blocks=2) == 1
    assert decide(policy, 0) == 0


def test_scales_down_by_one_only_after_idle_long_enough_with_room_to_spare():
    policy = ScalingPolicy(min_workers=1, max_workers=8, scale_down_idle_s=60.0)
    assert decide(policy, 4, num_free_blocks_total=300, idle_s=59.9) == 4
    assert decide(policy, 4, num_free_blocks_total=300, idle_s=60.0) == 3
    # Hysteresis: idle, but the remaining workers could not hold today's reservations.
    assert decide(policy, 4, num_free_blocks_total=99, idle_s=600.0) == 4
    # Anything pending blocks scale-down even with a long idle_s reported.
    assert decide(policy, 4, num_pending=1, num_pending_blocks=1, num_free_blocks_total=300, idle_s=600.0) == 4


def test_scale_down_is_clamped_to_min_workers():
    policy = ScalingPolicy(min_workers=2, max_workers=8, scale_down_idle_s=1.0)
    assert decide(policy, 2, num_free_blocks_total=200, idle_s=100.0) == 2


def test_pool_outside_bounds_goes_straight_to_them():
    policy = ScalingPolicy(min_workers=3, max_workers=5)
    assert decide(policy, 0) == 3
    assert decide(policy, 9, num_free_blocks_total=900) == 5


def test_roomiest_fit_is_what_first_fit_decreasing_picks_for_one_request():
    rng = random.Random(7)
    for _ in range(300):
        workers = [WorkerBudget(f"w{i:02d}", 40, rng.randint(0, 40)) for i in range(rng.randint(0, 12))]
        blocks = rng.randint(1, 40)
        chosen = first_fit_decreasing([PendingRequest("r", blocks, 0.0)], workers)
        assert roomiest_fit(blocks, {w.worker_id: w.num_free_blocks for w in workers}) == chosen.get("r")


def test_room_index_answers_like_roomiest_fit_through_random_changes():
    rng = random.Random(11)
    index = RoomIndex()
    for _ in range(3000):
        worker_id = f"w{rng.randint(0, 30):02d}"
        if rng.random() < 0.1:
            index.remove(worker_id)
        else:
            index.set(worker_id, rng.randint(0, 64))
        blocks = rng.randint(1, 64)
        exclude = worker_id if rng.random() < 0.2 else None
        free = {w: f for w, f in index.free().items() if w != exclude}
        assert index.roomiest(blocks, exclude=exclude) == roomiest_fit(blocks, free)


# --- prefix affinity -----------------------------------------------------------------------------


def test_the_worker_with_the_longest_cached_prefix_wins_when_it_is_not_much_fuller():
    free, total = {"w0": 60, "w1": 80, "w2": 70}, {"w0": 100, "w1": 100, "w2": 100}
    cached = {"w0": {1, 2, 3}, "w1": {1}, "w2": {9}}
    assert longest_cached_prefix([1, 2, 3, 4], cached["w0"]) == 3 and longest_cached_prefix([2, 3], cached["w0"]) == 2
    assert longest_cached_prefix([9, 1], cached["w1"]) == 0
    assert prefix_affinity([1, 2, 3, 4], 10, free, total, cached) == "w0"  # 20 points fuller than w1: allowed
    assert prefix_affinity([1, 2, 3, 4], 10, {**free, "w0": 50}, total, cached) is None  # 30 points: too loaded
    assert prefix_affinity([1, 2, 3, 4], 10, free, total, cached, max_load_gap=0.1) is None
    assert prefix_affinity([1, 2, 3, 4], 65, free, total, cached) == "w1"  # w0 has no room for 65
    assert prefix_affinity([7, 8], 10, free, total, cached) is None  # cached nowhere: place by room
    assert prefix_affinity([], 10, free, total, cached) is None
    tie = {"w0": {1}, "w1": {1}, "w2": {1}}
    assert prefix_affinity([1], 10, free, total, tie) == "w1"  # equal prefixes: the most free blocks
    assert prefix_affinity([1], 10, {"w1": 80, "w0": 80}, total, tie) == "w0"  # then the lower id
