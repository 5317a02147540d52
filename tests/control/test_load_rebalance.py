"""Which live request moves from the busiest worker to the idlest, and when (pure; no Ray or Redis)."""

import random

import pytest

from cluster.control.rebalance import MAX_TARGET_SHARE, Rebalance, WorkerLoad, choose_rebalance


def load(worker_id: str, running: list[str], waiting: list[str] = (), free: int = 100) -> WorkerLoad:
    return WorkerLoad(worker_id, (*running, *waiting), len(running), free)


def blocks(request_id: str) -> int:
    return 2


def test_the_busiest_workers_newest_waiting_request_goes_to_the_idlest():
    loads = [load("w1", ["a", "b", "c"], ["d", "e"]), load("w2", ["f"]), load("w3", ["g", "h"])]
    assert choose_rebalance(loads, blocks, min_gap=2) == Rebalance("e", "w1", "w2", 2)


def test_without_waiting_requests_the_newest_running_one_moves():
    loads = [load("w1", ["a", "b", "c", "d"]), load("w2", [])]
    assert choose_rebalance(loads, blocks, min_gap=2) == Rebalance("d", "w1", "w2", 2)


@pytest.mark.parametrize("busiest, idlest, min_gap, moves", [
    (3, 1, 2, True),
    (1, 0, 1, False),  # the idlest holds nothing, but a gap of 1 would only swap which is busier
    (3, 2, 2, False),  # a gap of 1 would only swap which worker is busier
    (3, 2, 1, False),  # ... whatever min_gap says
    (5, 2, 4, False),
    (6, 2, 4, True),
    (9, 0, 0, False),  # 0 turns rebalancing off
    (12, 7, 2, False),  # both busy: the idlest holds more than half the busiest's count
    (12, 6, 2, True),
])
def test_it_moves_only_when_the_gap_reaches_min_gap(busiest, idlest, min_gap, moves):
    loads = [load("w1", [f"a{i}" for i in range(busiest)]), load("w2", [f"b{i}" for i in range(idlest)])]
    assert (choose_rebalance(loads, blocks, min_gap) is not None) == moves


def test_kept_unknown_and_too_large_requests_stay_and_the_next_newest_goes():
    loads = [load("w1", ["a", "b", "c"], ["d"]), load("w2", [], free=3)]
    sizes = {"a": 1, "b": 2, "c": 9, "d": 1}
    unknown = {"a": 1, "b": 2, "c": 1, "d": None}
    # d is kept (moving, or moved before), c needs 9 blocks where 3 are free: b goes
    assert choose_rebalance(loads, sizes.get, 2, keep={"d"}) == Rebalance("b", "w1", "w2", 2)
    # d is not in the ledger (a request the controller does not know): c goes
    assert choose_rebalance(loads, unknown.get, 2).request_id == "c"
    assert choose_rebalance(loads, sizes.get, 2, keep={"a", "b", "d"}) is None
    assert choose_rebalance([load("w1", ["a", "b", "c"])], blocks, 2) is None  # one worker: nowhere to go


def test_ties_go_to_the_lowest_id_and_the_idlest_with_the_most_room():
    loads = [load("w2", ["a", "b", "c"]), load("w1", ["d", "e", "f"]), load("w4", [], free=5),
             load("w3", [], free=50)]
    assert choose_rebalance(loads, blocks, 2) == Rebalance("f", "w1", "w3", 2)


def test_applied_one_by_one_moves_settle_and_never_swing_back():
    rng = random.Random(0)
    for _ in range(200):
        workers = {f"w{i}": [f"r{i}-{j}" for j in range(rng.randrange(0, 12))] for i in range(rng.randrange(2, 6))}
        moved: list[str] = []
        for _ in range(100):
            move = choose_rebalance([load(w, ids) for w, ids in workers.items()], blocks, 2)
            if move is None:
                break
            workers[move.source].remove(move.request_id)
            workers[move.target].append(move.request_id)
            moved.append(move.request_id)
        busiest, idlest = max(len(ids) for ids in workers.values()), min(len(ids) for ids in workers.values())
        assert busiest - idlest <= 1 or idlest > MAX_TARGET_SHARE * busiest
        assert len(moved) == len(set(moved))  # no request went back and forth


def work_load(worker_id: str, remaining: dict[str, float], num_running: int | None = None,
              free: int = 100) -> WorkerLoad:
    ids = tuple(remaining)
    return WorkerLoad(worker_id, ids, len(ids) if num_running is None else num_running, free,
                      tuple(remaining.values()))


def test_by_work_two_long_requests_outweigh_four_that_end_soon():
    long_pair = work_load("w1", {"a": 500.0, "b": 480.0})
    short_four = work_load("w2", {"c": 10.0, "d": 8.0, "e": 5.0, "f": 2.0})
    idle = work_load("w3", {})
    # by counts w2 is the busiest; by work w1 is, and its newest request goes to the idlest
    assert choose_rebalance([long_pair, short_four, idle], blocks, 2).source == "w2"
    assert choose_rebalance([long_pair, short_four, idle], blocks, 2, by_work=True) == Rebalance("b", "w1", "w3", 2)


def test_by_work_a_move_only_narrows_the_gap_and_never_swings_it():
    source = work_load("w1", {"a": 100.0, "b": 300.0})
    target = work_load("w2", {"c": 150.0})
    # the gap is 250: "b" (300) would swing it the other way; "a" (100, at most half the gap) narrows it to 50
    assert choose_rebalance([source, target], blocks, 2, by_work=True) == Rebalance("a", "w1", "w2", 2)
    settled = [work_load("w1", {"b": 300.0}), work_load("w2", {"c": 150.0, "a": 100.0})]
    assert choose_rebalance(settled, blocks, 2, by_work=True) is None  # one request left: nothing to even out
    busy = [work_load("w1", {"a": 100.0, "b": 300.0}), work_load("w2", {"c": 210.0})]
    assert choose_rebalance(busy, blocks, 2, by_work=True) is None  # the idlest holds over half the work
    assert choose_rebalance([source, target], blocks, 0, by_work=True) is None  # off
    unknown = [work_load("w1", {}), WorkerLoad("w2", ("x", "y"), 2, 100)]  # workers that report no work
    assert choose_rebalance(unknown, blocks, 2, by_work=True) is None


def test_by_work_a_request_about_to_end_or_over_half_the_gap_stays():
    from cluster.control.rebalance import MIN_MOVE_TOKENS

    nearly_done = [work_load("w1", {"a": 500.0, "b": MIN_MOVE_TOKENS - 1}), work_load("w2", {})]
    assert choose_rebalance(nearly_done, blocks, 2, by_work=True) is None  # "b" ends too soon, "a" is over half
    # over half the gap: the target would end up busier than the source (100 against 20 here)
    assert choose_rebalance([work_load("w1", {"a": 10.0, "b": 80.0, "c": 10.0}), work_load("w2", {"d": 10.0})],
                            blocks, 2, by_work=True) is None
