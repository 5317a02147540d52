"""Late binding: a request waits in the controller's queue until some worker can start it, then goes where it is
predicted to finish soonest (real embedded Redis, simulated workers; the harness in `control_plane_driver.py`)."""

import asyncio

import pytest

from cluster.control.control_plane import ControlPlane
from cluster.control.messages import PlacementTimeoutError
from cluster.control.redis_server import connect_async
from cluster.control.store import ControllerStore
from control_plane_driver import control_plane_runner, outcome

# One slot per worker and a worker queue of 2 (placement.WORKER_QUEUE_SEQS): each worker is sent 3 requests while
# nothing waits there. s3_peak charges the prompt only (20 tokens: 2 of a worker's 10 blocks), so KV never binds.
SETTINGS = dict(policy="s3_peak", routing="predicted_work", max_num_seqs=1, max_pending_placements=16,
                late_binding=True)


@pytest.fixture
def run(server):
    return control_plane_runner(server.url)


async def fill(plane) -> list:
    """Three requests on each of the two workers: every place taken."""
    return [await asyncio.wait_for(plane.place(f"f{i}", 20, 1000, 100), 2.0) for i in range(6)]


def test_a_request_waits_at_the_controller_when_no_worker_can_start_it_and_the_shortest_goes_first(run):
    async def check(plane, sim):
        filled = await fill(plane)
        assert sorted(p.worker_id for p in filled) == ["w1"] * 3 + ["w2"] * 3
        long = asyncio.get_running_loop().create_task(plane.place("long", 20, 1000, 900))
        await asyncio.sleep(0.02)
        short = asyncio.get_running_loop().create_task(plane.place("short", 20, 1000, 10))
        await asyncio.sleep(0.05)
        assert not long.done() and not short.done()
        assert (await plane.store.get_request("long")).state == "pending"  # waiting in Redis, not on a worker
        assert plane.ledger.reserved_by_worker() == {"w1": 6, "w2": 6}  # 4 free blocks each, yet not placed
        await plane.finish(filled[0].request_id, outcome())
        placement = await asyncio.wait_for(short, 2.0)
        assert placement.worker_id == filled[0].worker_id and placement.queued_s > 0
        await asyncio.sleep(0.05)
        assert not long.done()  # passed by the shorter one that came after it
        await plane.finish(filled[1].request_id, outcome())
        assert (await asyncio.wait_for(long, 2.0)).worker_id == filled[1].worker_id
    run(check, **SETTINGS)


def test_without_late_binding_every_request_goes_to_a_worker_on_arrival(run):
    async def check(plane, sim):
        await fill(plane)
        late = await asyncio.wait_for(plane.place("late", 20, 1000, 10), 2.0)
        assert late.queued_s == 0.0 and (await plane.store.get_request("late")).state == "placed"
    run(check, **{**SETTINGS, "late_binding": False})


def test_a_worker_whose_own_queue_holds_requests_is_sent_only_what_it_runs_plus_its_queue(run):
    async def check(plane, sim):
        filled = await fill(plane)
        on_w2 = [p for p in filled if p.worker_id == "w2"]
        # w2 runs one and its KV test left two waiting: it holds what it runs plus 2 already. w1 reports nothing
        # waiting, so it may still be sent up to its 8 slots plus 2.
        sim.workers["w2"].held[on_w2[0].request_id] = on_w2[0].num_reserved_blocks
        for placement in on_w2[1:]:
            sim.report_overrun("w2", placement.request_id, 20, 0, 100, placement.num_reserved_blocks)
        await plane.tick()
        assert (plane.rooms.open_slots("w1"), plane.rooms.open_slots("w2")) == (7, 0)
        assert (await asyncio.wait_for(plane.place("next", 20, 1000, 10), 2.0)).worker_id == "w1"
    run(check, **{**SETTINGS, "max_num_seqs": 8})


def test_a_request_waiting_at_the_controller_survives_a_controller_restart(run, server):
    async def check(plane, sim):
        filled = await fill(plane)
        waiter = asyncio.get_running_loop().create_task(plane.place("late", 20, 1000, 10))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        waiter.cancel()  # the controller process is gone; Ray retries the router's call on its successor
        client = connect_async(server.url)
        restarted = ControlPlane(plane.config, ControllerStore(client), sim)
        await restarted.start()
        await restarted.tick()
        assert restarted.ledger.get("late").state == "pending"  # rebuilt from Redis, still waiting
        retried = asyncio.get_running_loop().create_task(restarted.place("late", 20, 1000, 10))
        await asyncio.sleep(0.05)
        assert not retried.done()  # the restarted controller counts the six placed requests: no place is open
        await restarted.finish(filled[3].request_id, outcome())
        placement = await asyncio.wait_for(retried, 2.0)
        assert placement.worker_id == filled[3].worker_id
        assert (await restarted.store.get_request("late")).state == "placed"
        await client.aclose()
    run(check, **SETTINGS)


def test_a_request_no_worker_could_start_in_time_is_refused_with_the_reason_and_leaves_nothing_behind(run):
    async def check(plane, sim):
        await fill(plane)
        with pytest.raises(PlacementTimeoutError, match="no worker had 2 free KV blocks and a free place within 0 s"):
            await plane.place("late", 20, 1000, 10)
        assert plane.ledger.get("late") is None and not plane.waiting
    run(check, **{**SETTINGS, "placement_timeout_s": 0.2})


@pytest.mark.parametrize("late_binding, chosen", [(False, "w1"), (True, "w2")])
def test_a_waiting_request_goes_to_the_roomiest_unless_late_binding_weighs_the_work_ahead(run, late_binding, chosen):
    async def check(plane, sim):
        assert (await plane.place("long", 20, 1000, 900)).worker_id == "w1"
        assert (await plane.place("short", 20, 1000, 10)).worker_id == "w2"  # where it ends soonest
        for worker_id in ("w1", "w2"):  # both full (what they report holding)
            sim.workers[worker_id].held["other"] = 10
        await plane.tick()
        waiter = asyncio.get_running_loop().create_task(plane.place("queued", 20, 1000, 100))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        sim.workers["w1"].held["other"] = 0  # w1 the roomier (8 free against 7), but its long answer runs on
        sim.workers["w2"].held["other"] = 3
        await plane.tick()
        return (await asyncio.wait_for(waiter, 2.0)).worker_id
    assert run(check, **{**SETTINGS, "max_num_seqs": 8, "late_binding": late_binding}) == chosen
