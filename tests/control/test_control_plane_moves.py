"""The control plane moves requests: an overrun to a worker with room, a live request from the busiest worker to
the idlest; refused and lost moves (real embedded Redis, simulated workers)."""

import asyncio

import pytest

from benchmarks.simulated_workers import SimulatedWorkerBackend
from cluster.control import mover as mover_module
from control_plane_driver import BLOCK_SIZE, BLOCKS, control_plane_runner, outcome


@pytest.fixture
def run(server):
    return control_plane_runner(server.url)


def test_an_overrun_moves_with_its_raised_bound_and_may_move_again(run):
    async def check(plane, sim):
        placement = await plane.place("a", 20, 200, 40)
        source = placement.worker_id
        target = "w2" if source == "w1" else "w1"
        # The worker preempted it at 41 tokens and raised its bound to 100 (next bucket edge).
        sim.report_overrun(source, "a", 20, 41, 100, 8)
        await plane.tick()
        assert sim.moves == [("a", source, target, True)]
        record = plane.ledger.get("a")
        assert (record.worker_id, record.predicted_output_tokens) == (target, 100)
        assert record.num_reserved_blocks == 8  # planned by the policy's rule: 20 + 100 tokens
        assert plane.counters["migrations"] == 1 and "a" in plane.moving
        sim.workers[target].held["a"] = 8  # the router resumed it there
        await plane.tick()  # the target holds it: the move is settled
        assert "a" not in plane.moving
        sim.report_overrun(target, "a", 20, 101, 120, 9)  # overran again: bound 120, 9 blocks
        await plane.tick()
        assert sim.moves[-1] == ("a", target, source, True)  # moved a second time
        assert plane.ledger.get("a").predicted_output_tokens == 120
    run(check)


async def hold_placed(plane, sim, request_ids) -> dict[str, list[str]]:
    """Place 1-block requests (prompt 8 + bound 8 tokens) and have their workers hold them; worker -> ids."""
    by_worker: dict[str, list[str]] = {"w1": [], "w2": []}
    for request_id in request_ids:
        placement = await plane.place(request_id, 8, 200, 8)
        sim.workers[placement.worker_id].held[request_id] = placement.num_reserved_blocks
        by_worker[placement.worker_id].append(request_id)
    await plane.tick()  # fresh stats
    return by_worker


async def imbalanced(plane, sim) -> dict[str, list[str]]:
    """Four 1-block requests on each worker, then three of w2's answers end: 4 live on w1, 1 on w2; one tick."""
    by_worker = await hold_placed(plane, sim, [f"r{i}" for i in range(8)])
    for request_id in by_worker["w2"][1:]:
        sim.workers["w2"].held.pop(request_id)
        await plane.finish(request_id, outcome())
    await plane.tick()
    return by_worker


def test_a_live_request_moves_from_the_busiest_worker_to_the_idlest_until_they_are_even(run):
    async def check(plane, sim):
        by_worker = await imbalanced(plane, sim)
        assert {w: len(ids) for w, ids in by_worker.items()} == {"w1": 4, "w2": 4}  # as placed
        newest = by_worker["w1"][-1]
        assert sim.moves == [(newest, "w1", "w2", True)]  # with its KV
        assert plane.ledger.get(newest).worker_id == "w2" and plane.ledger.reserved_by_worker() == {"w1": 3, "w2": 2}
        assert plane.counters["rebalances"] == 1 and plane.counters["migrations"] == 1
        await plane.tick()  # 3 against 2: settled, nothing more moves
        await plane.tick()
        assert len(sim.moves) == 1
        # w1 drains; w2 now holds its own request and the moved one (newest): the moved one stays
        for request_id in by_worker["w1"][:-1]:
            sim.workers["w1"].held.pop(request_id)
            await plane.finish(request_id, outcome())
        await plane.tick()
        await plane.tick()
        assert sim.moves[1:] == [(by_worker["w2"][0], "w2", "w1", True)]
    run(check)


class RefusingBackend(SimulatedWorkerBackend):
    """Workers that refuse every move (the request ended meanwhile, or the source is dying)."""

    async def move_out(self, handle, request_id, target_worker_id, with_kv):
        return False


class LosingBackend(SimulatedWorkerBackend):
    """Workers that end a moved request whose router never resumes it anywhere."""

    async def move_out(self, handle, request_id, target_worker_id, with_kv):
        return handle.held.pop(request_id, None) is not None


def test_a_refused_move_leaves_the_request_where_it_was(run):
    async def check(plane, sim):
        by_worker = await imbalanced(plane, sim)
        newest = by_worker["w1"][-1]
        assert plane.ledger.get(newest).worker_id == "w1" and plane.ledger.reserved_by_worker() == {"w1": 4, "w2": 1}
        assert not plane.moving and "rebalances" not in plane.counters and "migrations" not in plane.counters
    run(check, backend=RefusingBackend(num_total_blocks=BLOCKS, block_size=BLOCK_SIZE))


def test_a_move_whose_target_never_gets_the_request_is_given_up(run, monkeypatch):
    monkeypatch.setattr(mover_module, "MOVE_GIVE_UP_S", 0.0)

    async def check(plane, sim):
        by_worker = await imbalanced(plane, sim)
        lost = by_worker["w1"][-1]
        assert list(plane.moving) == [lost]  # its router died before resuming it on w2
        await asyncio.sleep(0.01)
        await plane.tick()
        # given up, and rebalancing goes on: w1 (3 live) still has twice w2's, so its next newest moves
        assert list(plane.moving) == [by_worker["w1"][-2]] and sim.moves == []
    run(check, backend=LosingBackend(num_total_blocks=BLOCKS, block_size=BLOCK_SIZE))


def test_rebalancing_off_moves_nothing(run):
    async def check(plane, sim):
        by_worker = await hold_placed(plane, sim, [f"r{i}" for i in range(8)])
        for request_id in by_worker["w2"]:
            sim.workers["w2"].held.pop(request_id)
            await plane.finish(request_id, outcome())
        await plane.tick()
        await plane.tick()
        assert not sim.moves and "rebalances" not in plane.counters
    run(check, rebalance_min_gap=0)


def test_with_predicted_work_routing_the_worker_with_more_work_ahead_gives_a_request_away(run):
    async def check(plane, sim):
        by_worker = await hold_placed(plane, sim, [f"r{i}" for i in range(6)])  # 3 on each worker
        heavy, light = sim.workers["w1"], sim.workers["w2"]
        for index, request_id in enumerate(by_worker["w1"]):
            heavy.remaining[request_id] = 400 - 100 * index  # 400, 300, 200 tokens to go
        for request_id in by_worker["w2"]:
            light.remaining[request_id] = 5
        await plane.tick()  # the stats poll brings the work, and the controller rebalances by it
        await plane.tick()
        # equal counts, so counting would move nothing; by work w1's newest (200 < the gap of 885) goes to w2
        assert sim.moves[:1] == [(by_worker["w1"][-1], "w1", "w2", True)]
        assert plane.counters["rebalances"] >= 1
    run(check, routing="predicted_work")
