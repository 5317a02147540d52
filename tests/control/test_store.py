"""Controller state in the real embedded Redis through the asyncio store: round trips, indices, restarts, the ledger."""

import asyncio
import dataclasses
import random

import pytest

from cluster.control.ledger import Ledger
from cluster.control.messages import RequestRecord, WorkerRecord
from cluster.control.redis_server import EmbeddedRedis, connect, connect_async
from cluster.control.store import ControllerStore


@pytest.fixture
def run(server):
    """run(fn): fn(store) in a fresh event loop over a flushed database (clients belong to one loop)."""
    connect(server.url).flushdb()

    def runner(fn, **client_options):
        async def main():
            client = connect_async(server.url, **client_options)
            try:
                return await fn(ControllerStore(client))
            finally:
                await client.aclose()
        return asyncio.run(main())

    return runner


def make_worker(worker_id: str = "w0", state: str = "ready") -> WorkerRecord:
    return WorkerRecord(worker_id=worker_id, actor_name=f"s3serve-worker-{worker_id}", num_total_blocks=512,
                        block_size=16, state=state, started_s=1700000000.125)


def make_request(request_id: str = "r0", worker_id: str | None = None, state: str = "pending",
                 num_reserved_blocks: int = 0, created_s: float = 1.5) -> RequestRecord:
    return RequestRecord(request_id=request_id, worker_id=worker_id, num_prompt_tokens=40, max_tokens=256,
                         predicted_output_tokens=96, num_reserved_blocks=num_reserved_blocks, state=state,
                         num_attempts=1, created_s=created_s)


def test_worker_round_trip_and_removal(run):
    async def check(store):
        assert await store.workers() == []
        await store.put_worker(make_worker("w1", state="starting"))
        await store.put_worker(make_worker("w0"))
        assert [w.worker_id for w in await store.workers()] == ["w0", "w1"]
        await store.put_worker(make_worker("w1"))  # a state change replaces the record
        assert [w.state for w in await store.workers()] == ["ready", "ready"]
        await store.remove_worker("w1")
        assert await store.workers() == [make_worker("w0")]
    run(check)


def test_request_round_trip_keeps_every_field(run):
    async def check(store):
        record = make_request("a:b/c", worker_id="w0", state="placed", num_reserved_blocks=9, created_s=0.1 + 0.2)
        await store.put_request(record)
        assert await store.get_request("a:b/c") == record
        assert await store.get_request("missing") is None
        await store.put_request(make_request("p"))
        assert (await store.get_request("p")).worker_id is None
    run(check)


def test_state_and_worker_indices_follow_updates(run):
    async def check(store):
        await store.put_request(make_request("r0", created_s=2.0))
        await store.put_request(make_request("r1", created_s=1.0))
        assert [r.request_id for r in await store.requests("pending")] == ["r1", "r0"]  # oldest first
        placed = make_request("r0", worker_id="w0", state="placed", num_reserved_blocks=8, created_s=2.0)
        await store.put_request(placed)
        assert [r.request_id for r in await store.requests("pending")] == ["r1"]
        assert await store.requests("placed") == [placed]
        assert await store.requests_on("w0") == [placed]
        moved = dataclasses.replace(placed, worker_id="w1", num_attempts=2)  # a migration
        await store.put_request(moved)
        assert await store.requests_on("w0") == [] and await store.requests_on("w1") == [moved]
        requeued = dataclasses.replace(moved, worker_id=None, state="pending", num_reserved_blocks=0)
        await store.put_request(requeued)
        assert await store.requests_on("w1") == [] and await store.requests("placed") == []
        assert {r.request_id for r in await store.requests("pending")} == {"r0", "r1"}
        with pytest.raises(ValueError, match="got 'running'"):
            await store.requests("running")
    run(check)


def test_delete_with_counter_and_sample_leaves_no_index_behind(run):
    async def check(store):
        await store.put_request(make_request("r0", worker_id="w0", state="placed", num_reserved_blocks=4))
        await store.delete_request("r0", counter="finished_stop", stream=("s3:test:samples", {"n": 1}, 10))
        await store.delete_request("r0")  # a no-op the second time
        assert await store.get_request("r0") is None and await store.requests() == []
        assert await store.counters() == {"finished_stop": 1}
        assert await store.client.xlen("s3:test:samples") == 1
        keys = set(await store.client.keys("s3:ctl:*"))
        assert keys == {"s3:ctl:counters", "s3:ctl:finished:r0:finished_stop"}, keys
        assert 0 < await store.client.ttl("s3:ctl:finished:r0:finished_stop") <= 3600
    run(check)


def test_a_finish_retried_or_replayed_counts_once(run):
    """A release whose reply was lost is sent again; one replayed after a Redis restart finds no record: one count."""
    async def check(store):
        sample = ("s3:test:samples", {"n": 1}, 10)
        await store.put_request(make_request("r0", worker_id="w0", state="placed", num_reserved_blocks=4))
        for _ in range(3):
            await store.delete_request("r0", counter="finished_stop", stream=sample)
        await store.delete_request("r1", counter="finished_length", stream=sample)  # never stored: still counted
        await store.delete_request("r1", counter="finished_length", stream=sample)
        assert await store.counters() == {"finished_stop": 1, "finished_length": 1}
        assert await store.client.xlen("s3:test:samples") == 2
    run(check)


def test_counters_are_raised_never_lowered(run):
    async def check(store):
        await store.incr("worker_ids", 5)
        await store.incr("requeues", 1)
        await store.raise_counters({"worker_ids": 3, "requeues": 4, "finished_stop": 2})
        assert await store.counters() == {"worker_ids": 5, "requeues": 4, "finished_stop": 2}
    run(check)


def test_run_id_changes_when_redis_restarts(tmp_path):
    async def run_ids(url):
        client = connect_async(url)
        try:
            return await ControllerStore(client).run_id()
        finally:
            await client.aclose()

    with EmbeddedRedis(tmp_path) as server:
        first = asyncio.run(run_ids(server.url))
        assert asyncio.run(run_ids(server.url)) == first
        server.restart()
        assert asyncio.run(run_ids(server.url)) != first


def test_each_state_change_is_one_round_trip(run, server):
    """The Lua scripts replace WATCH/HMGET/MULTI: Redis sees one EVALSHA per change, and no WATCH at all."""
    async def check(store):
        await store.put_request(make_request("warm"))  # loads the script once
        admin = connect(server.url)
        admin.config_resetstat()
        await store.put_request(make_request("r0"))
        await store.put_request(make_request("r0", worker_id="w0", state="placed", num_reserved_blocks=3))
        await store.delete_request("r0", counter="finished_stop")
        stats = admin.info("commandstats")
        calls = {name.removeprefix("cmdstat_"): value["calls"] for name, value in stats.items()}
        assert calls.get("evalsha") == 3 and "watch" not in calls and "multi" not in calls, calls
    run(check)


def test_counters_and_config(run):
    async def check(store):
        assert await store.counters() == {}
        assert await store.incr("migrations") == 1 and await store.incr("migrations", 2) == 3
        assert await store.counters() == {"migrations": 3}
        assert await store.get_config() is None
        await store.set_config('{"policy": "s3"}')
        assert await store.get_config() == '{"policy": "s3"}'
    run(check)


def test_prefixes_keep_stores_apart(run):
    async def check(store):
        other = ControllerStore(store.client, prefix="other")
        await store.put_request(make_request("r0"))
        await store.incr("overruns")
        assert await other.requests() == [] and await other.counters() == {}
        assert all(key.startswith("s3:") for key in await store.client.keys("*"))
        with pytest.raises(ValueError, match="prefix"):
            ControllerStore(store.client, prefix="")
    run(check)


def test_records_validate_their_fields():
    with pytest.raises(ValueError, match="state must be one of .* got 'gone'"):
        make_worker(state="gone")
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        dataclasses.replace(make_worker(), block_size=0)
    with pytest.raises(ValueError, match="got 'finished'"):
        make_request(state="finished")
    with pytest.raises(ValueError, match="num_reserved_blocks must be >= 0, got -1"):
        make_request(num_reserved_blocks=-1)
    with pytest.raises(ValueError, match="worker_id must be None or non-empty"):
        make_request(worker_id="")
    with pytest.raises(ValueError, match="a placed request needs a worker_id"):
        make_request(state="placed")


def test_state_survives_a_redis_restart_and_the_store_keeps_working(run, server):
    async def check(store):
        await store.put_worker(make_worker("w0"))
        placed = make_request("r0", worker_id="w0", state="placed", num_reserved_blocks=6)
        await store.put_request(placed)
        await store.incr("migrations")
        await asyncio.get_running_loop().run_in_executor(None, server.restart)
        assert await store.ping()
        assert await store.workers() == [make_worker("w0")]
        assert await store.get_request("r0") == placed  # the script cache was flushed: reloaded transparently
        await store.put_request(dataclasses.replace(placed, num_reserved_blocks=7))
        assert (await store.requests("placed"))[0].num_reserved_blocks == 7
        assert await store.counters() == {"migrations": 1}
    run(check)


def test_ping_is_false_when_redis_is_gone(tmp_path):
    async def check():
        with EmbeddedRedis(tmp_path) as embedded:
            store = ControllerStore(connect_async(embedded.url, max_retry_s=0.2, socket_timeout_s=0.5))
            assert await store.ping()
        assert not await store.ping()
    asyncio.run(check())


def test_concurrent_writers_never_leave_indices_inconsistent(run):
    async def check(store):
        async def churn(seed: int) -> None:
            rng = random.Random(seed)
            for _ in range(150):
                state = rng.choice(("pending", "placed"))
                worker_id = rng.choice(["w0", "w1", "w2"]) if state == "placed" else None
                record = make_request(f"r{rng.randint(0, 2)}", worker_id=worker_id, state=state,
                                      num_reserved_blocks=rng.randint(0, 9))
                if rng.random() < 0.2:
                    await store.delete_request(record.request_id)
                else:
                    await store.put_request(record)

        await asyncio.gather(*(churn(seed) for seed in range(3)))
        records = await store.requests()
        for state in ("pending", "placed"):
            assert {r.request_id for r in await store.requests(state)} == {
                r.request_id for r in records if r.state == state}
        for worker_id in ("w0", "w1", "w2"):
            assert {r.request_id for r in await store.requests_on(worker_id)} == {
                r.request_id for r in records if r.worker_id == worker_id}
    run(check)


def test_ledger_reads_memory_writes_through_and_rebuilds_from_redis(run):
    async def check(store):
        ledger = Ledger(store)
        await ledger.put(make_request("a", worker_id="w0", state="placed", num_reserved_blocks=5))
        await ledger.put(make_request("b", worker_id="w0", state="placed", num_reserved_blocks=7))
        await ledger.put(make_request("c", worker_id="w1", state="placed", num_reserved_blocks=3))
        await ledger.put(make_request("d"))
        assert ledger.reserved_by_worker() == {"w0": 12, "w1": 3}
        await ledger.put(dataclasses.replace(ledger.get("b"), worker_id="w1"))  # moved
        await ledger.remove("a")
        assert ledger.reserved_by_worker() == {"w1": 10}
        rebuilt = Ledger(store)
        await rebuilt.load()
        assert rebuilt.reserved_by_worker() == {"w1": 10} and len(rebuilt) == 3
    run(check)


def test_a_failed_placement_write_is_undone_and_a_failed_release_is_queued_until_sync(tmp_path):
    """Redis down: a placement is refused (memory as before); a release stays done and reaches Redis, counted
    once, when it is back."""
    async def check():
        embedded = EmbeddedRedis(tmp_path, appendfsync="always")
        url = embedded.start()
        store = ControllerStore(connect_async(url, max_retry_s=0.2, socket_timeout_s=0.5))
        ledger = Ledger(store)
        await ledger.put(make_request("a", worker_id="w0", state="placed", num_reserved_blocks=5))
        await ledger.put(make_request("c", worker_id="w1", state="placed", num_reserved_blocks=2))
        embedded.stop()
        with pytest.raises(Exception):
            await ledger.put(make_request("b", worker_id="w0", state="placed", num_reserved_blocks=9))
        sample = ("s3:test:samples", {"n": 1}, 10)
        assert (await ledger.remove("a", counter="finished_stop", stream=sample)).request_id == "a"
        assert ledger.reserved_by_worker() == {"w1": 2} and ledger.get("b") is None and ledger.get("a") is None
        assert ledger.needs_sync and ledger.num_unwritten == 1
        with pytest.raises(Exception):
            await ledger.sync()  # still down: nothing lost, still queued
        assert ledger.num_unwritten == 1 and ledger.needs_sync
        embedded.start()  # same port and data: "a" and "c" are still in Redis
        assert await ledger.sync() == (0, 0)
        assert await ledger.sync() == (0, 0) and not ledger.needs_sync
        assert [r.request_id for r in await store.requests()] == ["c"]
        assert await store.counters() == {"finished_stop": 1}
        assert await store.client.xlen("s3:test:samples") == 1
        await store.client.aclose()
        embedded.stop()
    asyncio.run(check())


def test_sync_makes_redis_equal_to_memory_after_redis_lost_writes(run):
    """A Redis restarted without its last writes: sync rewrites what memory has and drops what it has not."""
    async def check(store):
        ledger = Ledger(store)
        await ledger.put(make_request("a", worker_id="w0", state="placed", num_reserved_blocks=5))
        await ledger.put(make_request("b", worker_id="w0", state="placed", num_reserved_blocks=3))
        await store.delete_request("a")  # lost from Redis
        await store.put_request(make_request("stale", worker_id="w1", state="placed", num_reserved_blocks=4))
        await store.put_request(dataclasses.replace(ledger.get("b"), num_reserved_blocks=1))  # an older version
        assert await ledger.sync() == (1, 2)
        rebuilt = Ledger(store)
        await rebuilt.load()
        assert {r.request_id: r for r in rebuilt.records()} == {r.request_id: r for r in ledger.records()}
        assert rebuilt.reserved_by_worker() == {"w0": 8}
    run(check)
