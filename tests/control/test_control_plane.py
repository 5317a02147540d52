"""The control plane without Ray: real embedded Redis, simulated workers (`benchmarks.simulated_workers`).

Moves and rebalancing are in `test_control_plane_moves.py`; the harness in `control_plane_driver.py`.
"""

import asyncio
import dataclasses

import pytest

from benchmarks.simulated_workers import SimulatedWorkerBackend
from cluster.control import control_plane as plane_module
from cluster.control.control_plane import ControlPlane
from cluster.control.messages import PlacementTimeoutError, QueueFullError
from cluster.control.redis_server import EmbeddedRedis, connect_async
from cluster.control.store import ControllerStore
from control_plane_driver import BLOCK_SIZE, BLOCKS, config, control_plane_runner, outcome, until


@pytest.fixture
def run(server):
    return control_plane_runner(server.url)


def test_places_by_plan_first_fit_and_releases_in_one_write(run):
    async def check(plane, sim):
        # s3 plans prompt 20 + bound 40 = 60 tokens = 4 blocks of 16
        first = await plane.place("a", 20, 200, 40)
        assert first.num_reserved_blocks == 4 and first.worker_id in ("w1", "w2")
        second = await plane.place("b", 20, 200, 40)
        assert second.worker_id != first.worker_id  # first fit on the roomiest: the other one
        stored = await plane.store.get_request("a")
        assert stored.state == "placed" and stored.worker_id == first.worker_id
        await plane.finish("a", outcome())
        assert await plane.store.get_request("a") is None
        assert plane.ledger.reserved_by_worker() == {second.worker_id: 4}
        assert (await plane.status()).counters["finished_stop"] == 1
        assert await plane.store.client.xlen("s3:predictor:samples") == 1  # a training sample
    run(check)


def test_a_request_waits_for_room_and_takes_it_when_a_release_frees_it(run):
    async def check(plane, sim):
        big = [await plane.place(f"big{i}", 20, 200, 140) for i in range(2)]  # 10 blocks each: both full
        assert {p.worker_id for p in big} == {"w1", "w2"}
        waiter = asyncio.get_running_loop().create_task(plane.place("late", 20, 200, 40))
        await asyncio.sleep(0.05)
        assert not waiter.done() and (await plane.store.get_request("late")).state == "pending"
        await plane.finish("big0", outcome())
        placement = await asyncio.wait_for(waiter, 2.0)
        assert placement.worker_id == big[0].worker_id and placement.queued_s > 0
    run(check)


def test_a_full_queue_is_refused_and_a_timeout_leaves_nothing_behind(run):
    async def check(plane, sim):
        for i in range(2):
            await plane.place(f"big{i}", 20, 200, 140)
        waiters = [asyncio.get_running_loop().create_task(plane.place(f"w{i}", 20, 200, 40)) for i in range(4)]
        await asyncio.sleep(0.05)
        with pytest.raises(QueueFullError, match="4 requests already wait for a worker"):
            await plane.place("one-too-many", 20, 200, 40)
        with pytest.raises(PlacementTimeoutError, match="no worker had 4 free KV blocks within 0 s"):
            await asyncio.gather(*waiters)
        await asyncio.sleep(0.3)
        assert {r.request_id for r in await plane.store.requests()} == {"big0", "big1"}
    run(check, placement_timeout_s=0.2)


def test_a_restarted_control_plane_rebuilds_from_redis_and_answers_the_same(run, server):
    async def check(plane, sim):
        placement = await plane.place("a", 20, 200, 40)
        client = connect_async(server.url)
        restarted = ControlPlane(plane.config, ControllerStore(client), sim)
        await restarted.start()  # finds both workers alive: starts none
        assert sorted(restarted.pool.handles) == ["w1", "w2"] and len(sim.workers) == 2
        await restarted.tick()
        assert sorted(restarted.pool.ready_ids()) == ["w1", "w2"]  # its first poll finds both answering
        again = await restarted.place("a", 20, 200, 40)  # a retried call: the same placement
        assert (again.worker_id, again.num_reserved_blocks) == (placement.worker_id, placement.num_reserved_blocks)
        assert restarted.ledger.reserved_by_worker() == {placement.worker_id: 4}
        await client.aclose()
    run(check)


def test_a_dead_worker_is_replaced_and_its_requests_requeued_for_their_routers(run):
    async def check(plane, sim):
        placement = await plane.place("a", 20, 200, 40)
        sim.kill_worker(placement.worker_id)
        await plane.tick()
        assert placement.worker_id not in plane.pool.handles
        assert plane.ledger.get("a").state == "pending"  # the router re-places it
        assert plane.counters["requeues"] == 1
        await until(lambda: len(plane.pool.ready_ids()) == 2)  # replaced
        again = await plane.place("a", 20, 200, 40, num_resumed_tokens=10, exclude_worker_id=placement.worker_id)
        assert again.worker_id != placement.worker_id and plane.ledger.get("a").num_attempts == 2
        dead = [r for r in (await plane.status()).workers if r.state == "dead"]
        assert [r.worker_id for r in dead] == [placement.worker_id]
    run(check)


def test_reconcile_drops_entries_no_router_or_worker_will_release(run, monkeypatch):
    monkeypatch.setattr(plane_module, "RECONCILE_GRACE_S", 0.0)
    monkeypatch.setattr(plane_module, "RECONCILE_INTERVAL_S", 0.0)

    async def check(plane, sim):
        await plane.place("orphan", 20, 200, 40)  # its router died before reaching the worker
        held = await plane.place("held", 20, 200, 40)
        sim.workers[held.worker_id].held["held"] = held.num_reserved_blocks
        await plane.tick()
        assert plane.ledger.get("orphan") is None and plane.ledger.get("held") is not None
        assert plane.counters["reconciled"] == 1 and await plane.store.get_request("orphan") is None
    run(check)


async def started_plane(url: str) -> tuple[ControlPlane, object]:
    """A started control plane with 2 ready simulated workers over Redis at `url`, with a client that gives up
    fast (for tests that stop that Redis); returns it and its client."""
    client = connect_async(url, max_retry_s=0.3, socket_timeout_s=0.5)
    sim = SimulatedWorkerBackend(num_total_blocks=BLOCKS, block_size=BLOCK_SIZE)
    plane = ControlPlane(config(), ControllerStore(client), sim)
    await plane.start()
    await until(lambda: len(plane.pool.ready_ids()) == 2)
    return plane, client


def test_with_redis_down_placement_fails_fast_and_changes_nothing(tmp_path):
    async def check():
        embedded = EmbeddedRedis(tmp_path)
        plane, _ = await started_plane(embedded.start())
        await plane.place("a", 20, 200, 40)
        before = plane.ledger.reserved_by_worker()
        embedded.stop()
        started = asyncio.get_running_loop().time()
        with pytest.raises(Exception):
            await plane.place("b", 20, 200, 40)
        assert asyncio.get_running_loop().time() - started < 3.0
        assert plane.ledger.reserved_by_worker() == before and plane.ledger.get("b") is None
        assert not (await plane.status()).is_redis_ok
        plane.pool.backend.report_bound(plane.ledger.get("a").worker_id, "a", 5, 100)
        await plane.tick()  # the new bound cannot be written: the tick goes on, memory as it was
        assert plane.ledger.get("a").predicted_output_tokens == 40 and plane.ledger.reserved_by_worker() == before
    asyncio.run(check())


def test_after_redis_comes_back_empty_the_controller_writes_its_memory_back(tmp_path):
    """Redis dies, a request finishes meanwhile, and Redis comes back with nothing (worse than a lost second
    of writes): the release is kept, Redis gets the ledger, workers and counters back, the finish counts once."""
    async def check():
        first = EmbeddedRedis(tmp_path / "before")
        plane, client = await started_plane(first.start())
        await plane.place("a", 20, 200, 40)
        b = await plane.place("b", 20, 200, 40)
        first.stop()
        await plane.finish("a", outcome())  # released in memory, queued for Redis
        assert plane.ledger.get("a") is None and plane.ledger.num_unwritten == 1
        await plane.tick()  # Redis still down: the tick goes on without it
        second = EmbeddedRedis(tmp_path / "after", port=first.port)
        second.start()
        try:
            await plane.tick()
            store = plane.store
            assert [r.request_id for r in await store.requests()] == ["b"]
            assert (await store.get_request("b")).worker_id == b.worker_id
            assert {w.worker_id for w in await store.workers()} == {"w1", "w2"}
            counters = await store.counters()
            assert counters["finished_stop"] == 1 and counters["worker_ids"] == 2
            assert await store.client.xlen("s3:predictor:samples") == 1  # the training sample was kept
            assert plane.resync.num_redis_restarts == 1 and not plane.ledger.needs_sync
            await plane.tick()
            assert (await store.counters())["finished_stop"] == 1  # nothing twice
            assert (await plane.place("c", 20, 200, 40)).num_reserved_blocks == 4  # and placement works again
            await store.client.hdel("s3:ctl:counters", "worker_ids")  # an increment lost again
            assert await plane.pool.start_worker() == "w3"  # never an id that is already taken
        finally:
            await client.aclose()
            second.stop()
    asyncio.run(check())


def test_the_plan_is_the_worker_policy_rule(run):
    async def check(plane, sim):
        paged = await plane.place("p", 20, 200, 40)
        assert paged.num_reserved_blocks == 2  # paged_greedy plans the prompt only: 20 tokens
        resumed = await plane.place("r", 20, 200, None, num_resumed_tokens=30)
        assert resumed.num_reserved_blocks == 4  # 20 + 30 known tokens (+ nothing planned ahead)
    run(check, policy="paged_greedy")


def test_s3_peak_is_charged_its_prompt_and_its_workers_peak_test_decides(run):
    async def check(plane, sim):
        # Plans of 20 + 140 = 10 blocks would fill both workers with two requests; s3_peak is charged its prompt
        # (2 blocks) and the worker's future-peak test decides when each runs, so none waits at the controller.
        placements = [await asyncio.wait_for(plane.place(f"p{i}", 20, 200, 140), 2.0) for i in range(4)]
        assert [p.num_reserved_blocks for p in placements] == [2, 2, 2, 2]
        assert plane.ledger.reserved_by_worker() == {"w1": 4, "w2": 4}
    run(check, policy="s3_peak")


@pytest.mark.parametrize("policy, first", [("s3_peak", "short"), ("paged_greedy", "long")])
def test_the_queue_places_shortest_predicted_work_first_where_the_worker_admits(run, policy, first):
    async def check(plane, sim):
        # w1 keeps 1 free block, w2 none; two 2-block requests queue, the one predicted to run long first.
        for request_id, prompt_tokens in (("a", 128), ("b", 160), ("c", 16)):
            await plane.place(request_id, prompt_tokens, 1000, 10)
        long = asyncio.get_running_loop().create_task(plane.place("long", 20, 1000, 900))
        await asyncio.sleep(0.02)
        short = asyncio.get_running_loop().create_task(plane.place("short", 20, 1000, 10))
        await asyncio.sleep(0.05)
        assert not long.done() and not short.done()
        await plane.finish("c", outcome())  # room for one of them
        done, _ = await asyncio.wait({long, short}, timeout=2.0, return_when=asyncio.FIRST_COMPLETED)
        placed = {task.get_name() for task in done}
        for task in (long, short):
            task.cancel()
        return placed, {long.get_name(): "long", short.get_name(): "short"}
    placed, names = run(check, policy=policy, max_queue_wait_s=30.0)
    assert [names[name] for name in placed] == [first]


@pytest.mark.parametrize("policy, grows", [("s3_peak", True), ("s3", False)])
def test_requests_waiting_in_the_workers_grow_the_pool_where_the_policy_takes_blocks_on_demand(run, policy, grows):
    async def check(plane, sim):
        # Three requests wait in w1's queue and none at the controller: for an on-demand policy that is its
        # backlog (it was charged less than it will hold); a policy holding its plan only queues at the controller.
        for i in range(3):
            sim.report_overrun("w1", f"q{i}", 20, 5, 40, 4)
        await plane.tick()
        return sorted(plane.pool.handles)
    workers = run(check, policy=policy, max_workers=3, scale_up_queue_depth=1, rebalance_min_gap=0)
    assert (workers == ["w1", "w2", "w3"]) == grows, workers


def test_a_router_re_placing_while_the_tick_handles_the_death_is_counted_as_one_requeue(run):
    """The tick's poll found the worker dead and is still writing that down (a Redis round trip) when the router
    that lost the stream re-places the request: one requeue, not none (seen in the service e2e test)."""
    async def check(plane, sim):
        first = await plane.place("a", 20, 200, 40)
        sim.kill_worker(first.worker_id)
        mark_dead, marking = plane.pool.mark_dead, asyncio.Event()

        async def slow_mark_dead(worker_id: str) -> bool:
            gone = await mark_dead(worker_id)
            marking.set()
            await asyncio.sleep(0.2)  # a slow Redis write, before the tick reads the dead worker's requests
            return gone

        plane.pool.mark_dead = slow_mark_dead
        tick = asyncio.create_task(plane.tick())
        await marking.wait()
        second = await plane.place("a", 20, 200, 40, num_resumed_tokens=5, exclude_worker_id=first.worker_id)
        await tick
        assert second.worker_id != first.worker_id and plane.ledger.get("a").worker_id == second.worker_id
        assert plane.counters["requeues"] == 1
    run(check)


def test_records_are_replaced_not_duplicated_on_re_placement(run):
    async def check(plane, sim):
        first = await plane.place("a", 20, 200, 40)
        sim.kill_worker(first.worker_id)
        second = await plane.place("a", 20, 200, 40, num_resumed_tokens=5, exclude_worker_id=first.worker_id)
        records = await plane.store.requests()
        assert [dataclasses.astuple(r)[:2] for r in records] == [("a", second.worker_id)]
    run(check)


def test_a_request_goes_where_its_prefix_is_cached_and_by_room_when_that_is_off(run):
    async def check(plane, sim):
        warm = await plane.place("warm", 10, 200, 6)  # 1 block of 10: that worker is now the fuller one
        sim.workers[warm.worker_id].prefix_hashes = (11, 12, 13)
        await plane.tick()  # the stats poll brings the reported hashes
        placement = await plane.place("shared", 20, 200, 40, prefix_hashes=(11, 12, 99))
        assert placement.worker_id == warm.worker_id  # not the roomier one: its prefix is cached there
        other = await plane.place("stranger", 20, 200, 40, prefix_hashes=(55,))
        assert other.worker_id != warm.worker_id  # nothing cached anywhere: by room
        for request_id in ("warm", "shared", "stranger"):
            await plane.finish(request_id, outcome())
        plane.adopt(plane.config.model_copy(update={"prefix_aware_placement": False}))
        await plane.place("warm2", 10, 200, 6)
        again = await plane.place("shared2", 20, 200, 40, prefix_hashes=(11, 12, 99))
        assert again.worker_id != plane.ledger.get("warm2").worker_id  # by room only
    run(check)


def test_a_sibling_choice_goes_beside_its_leader_while_that_worker_has_room(run):
    """Choices of one `n` share their prompt's cached blocks only on one worker: a sibling follows its leader there,
    even to the fuller worker, and is routed as usual when it does not fit there or its leader is unknown."""
    async def check(plane, sim):
        leader = await plane.place("cmpl-0-0", 20, 200, 40)  # 4 blocks: the other worker is now the roomier
        sibling = await plane.place("cmpl-0-1", 20, 200, 40, sibling_of="cmpl-0-0")
        assert sibling.worker_id == leader.worker_id
        free = plane.rooms.free()[leader.worker_id]  # 2 of 10 blocks
        too_big = await plane.place("cmpl-0-2", 20, 200, free * BLOCK_SIZE, sibling_of="cmpl-0-0")
        assert too_big.worker_id != leader.worker_id  # no room beside the leader: where it fits
        orphan = await plane.place("orphan", 20, 200, 20, sibling_of="never-placed")
        assert orphan.worker_id != leader.worker_id  # an unknown leader: by room
    run(check)


def test_a_bound_the_workers_probe_lowers_frees_room_for_a_waiting_request(run):
    async def check(plane, sim):
        big = [await plane.place(f"big{i}", 20, 200, 140) for i in range(2)]  # 20 + 140 tokens: 10 blocks each
        waiter = asyncio.get_running_loop().create_task(plane.place("late", 20, 200, 40))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        sim.report_bound(big[0].worker_id, "big0", 10, 40)  # the probe read big0 after 10 tokens: 40 in all
        await plane.tick()
        record = plane.ledger.get("big0")
        assert (record.predicted_output_tokens, record.num_reserved_blocks) == (40, 4)  # 20 + 40 tokens
        assert (await plane.store.get_request("big0")).num_reserved_blocks == 4  # written through
        placement = await asyncio.wait_for(waiter, 2.0)
        assert placement.worker_id == big[0].worker_id
        sim.workers[big[1].worker_id].held["big1"] = 10  # admitted there: s3 holds its whole reservation
        sim.report_bound(big[1].worker_id, "big1", 30, 40)
        await plane.tick()
        record = plane.ledger.get("big1")
        assert (record.predicted_output_tokens, record.num_reserved_blocks) == (40, 10)  # the worker keeps 10
        sim.report_bound(big[0].worker_id, "big0", 30, 190)  # raised: the controller reserves more
        await plane.tick()
        assert plane.ledger.get("big0").num_reserved_blocks == BLOCKS  # 20 + 190 tokens, clamped to the cache
    run(check)


@pytest.mark.parametrize("routing, expected", [("predicted_work", "w2"), ("room", "w1"), ("least_requests", "w1")])
def test_a_request_goes_where_it_is_predicted_to_finish_soonest_or_by_the_routing_chosen(run, routing, expected):
    from cluster.control.messages import RequestRecord

    async def check(plane, sim):
        # w1 holds 1 request with 500 tokens still to come (1 block); w2 holds 3 finishing within 10 tokens
        # (3 blocks): by room and by count w1 is the lighter, by predicted work w2.
        placed = {"long": ("w1", 500)} | {f"short{i}": ("w2", 10 - 3 * i) for i in range(3)}
        for request_id, (worker_id, remaining) in placed.items():
            await plane.ledger.put(RequestRecord(request_id, worker_id, 10, 1000, 600, 1, "placed", 1, 0.0))
            sim.workers[worker_id].held[request_id] = 1
            sim.workers[worker_id].remaining[request_id] = remaining
        await plane.tick()  # the stats poll
        assert (await plane.place("new", 20, 200, 20)).worker_id == expected  # s3: 40 tokens, 3 blocks
    run(check, routing=routing)
