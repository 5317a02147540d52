"""Controller state in the real embedded Redis: round trips, indices, persistence across restarts."""

import dataclasses
import random
import threading

import pytest
import redis

from cluster.control.redis_server import EmbeddedRedis, connect
from cluster.control.store import ControllerStore, RequestRecord, WorkerRecord


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with EmbeddedRedis(tmp_path_factory.mktemp("redis")) as embedded:
        yield embedded


@pytest.fixture
def store(server):
    client = connect(server.url)
    client.flushdb()
    return ControllerStore(client)


def make_worker(worker_id: str = "w0", state: str = "ready") -> WorkerRecord:
    return WorkerRecord(worker_id=worker_id, actor_name=f"s3serve-worker-{worker_id}", num_total_blocks=512,
                        block_size=16, state=state, started_s=1700000000.125)


def make_request(request_id: str = "r0", worker_id: str | None = None, state: str = "pending",
                 num_reserved_blocks: int = 0, created_s: float = 1.5) -> RequestRecord:
    return RequestRecord(request_id=request_id, worker_id=worker_id, num_prompt_tokens=40, max_tokens=256,
                         predicted_output_tokens=96, num_reserved_blocks=num_reserved_blocks, state=state,
                         num_attempts=1, created_s=created_s, payload='{"prompt_token_ids": [1, 2, 3]}')


def test_worker_round_trip_and_removal(store):
    assert store.workers() == []
    store.put_worker(make_worker("w1", state="starting"))
    store.put_worker(make_worker("w0"))
    assert [w.worker_id for w in store.workers()] == ["w0", "w1"]
    assert store.get_worker("w1") == make_worker("w1", state="starting")
    store.put_worker(make_worker("w1"))  # state change replaces the record
    assert store.get_worker("w1").state == "ready"
    assert len(store.workers()) == 2
    store.remove_worker("w1")
    assert store.workers() == [make_worker("w0")]
    assert store.get_worker("w1") is None


def test_request_round_trip_keeps_every_field(store):
    record = make_request("a:b/c", worker_id="w0", state="placed", num_reserved_blocks=9, created_s=0.1 + 0.2)
    store.put_request(record)
    assert store.get_request("a:b/c") == record
    assert store.get_request("missing") is None
    pending = make_request("p")
    store.put_request(pending)
    assert store.get_request("p").worker_id is None


def test_state_and_worker_indices_follow_updates(store):
    store.put_request(make_request("r0", created_s=2.0))
    store.put_request(make_request("r1", created_s=1.0))
    assert [r.request_id for r in store.requests("pending")] == ["r1", "r0"]  # oldest first
    placed = make_request("r0", worker_id="w0", state="placed", num_reserved_blocks=8, created_s=2.0)
    store.put_request(placed)
    assert [r.request_id for r in store.requests("pending")] == ["r1"]
    assert store.requests("placed") == [placed]
    assert store.requests_on("w0") == [placed]
    # Migration: the request leaves w0's index and enters w1's.
    moved = dataclasses.replace(placed, worker_id="w1", num_attempts=2)
    store.put_request(moved)
    assert store.requests_on("w0") == []
    assert store.requests_on("w1") == [moved]
    # Requeue: back to pending with no worker.
    requeued = dataclasses.replace(moved, worker_id=None, state="pending", num_reserved_blocks=0)
    store.put_request(requeued)
    assert store.requests_on("w1") == []
    assert {r.request_id for r in store.requests("pending")} == {"r0", "r1"}
    assert store.requests("placed") == []
    assert len(store.requests()) == 2


def test_requests_on_filters_by_state(store):
    store.put_request(make_request("a", worker_id="w0", state="placed", num_reserved_blocks=3))
    store.put_request(make_request("b", worker_id="w0", state="finished", num_reserved_blocks=3))
    assert {r.request_id for r in store.requests_on("w0")} == {"a", "b"}
    assert [r.request_id for r in store.requests_on("w0", state="placed")] == ["a"]
    with pytest.raises(ValueError, match="state must be one of"):
        store.requests_on("w0", state="running")
    with pytest.raises(ValueError, match="got 'running'"):
        store.requests("running")


def test_delete_request_clears_its_indices(store):
    store.put_request(make_request("r0", worker_id="w0", state="placed", num_reserved_blocks=4))
    store.delete_request("r0")
    assert store.get_request("r0") is None
    assert store.requests() == []
    assert store.requests_on("w0") == []
    assert store.reserved_blocks_by_worker() == {}
    store.delete_request("r0")  # no-op the second time
    keys = set(store.client.keys("*"))
    assert keys == set(), keys  # no index left behind


def test_reserved_blocks_sum_placed_requests_only(store):
    store.put_request(make_request("a", worker_id="w0", state="placed", num_reserved_blocks=5))
    store.put_request(make_request("b", worker_id="w0", state="placed", num_reserved_blocks=7))
    store.put_request(make_request("c", worker_id="w1", state="placed", num_reserved_blocks=3))
    store.put_request(make_request("d", worker_id="w1", state="finished", num_reserved_blocks=100))
    store.put_request(make_request("e", state="pending", num_reserved_blocks=0))
    assert store.reserved_blocks_by_worker() == {"w0": 12, "w1": 3}


def test_counters(store):
    assert store.counters() == {}
    assert store.incr("migrations") == 1
    assert store.incr("migrations", 2) == 3
    assert store.incr("requeues") == 1
    assert store.counters() == {"migrations": 3, "requeues": 1}


def test_prefixes_keep_stores_apart(store):
    other = ControllerStore(store.client, prefix="other")
    store.put_request(make_request("r0"))
    store.incr("overruns")
    assert other.requests() == [] and other.counters() == {}
    assert all(key.startswith("s3:") for key in store.client.keys("*"))
    with pytest.raises(ValueError, match="prefix"):
        ControllerStore(store.client, prefix="")


def test_records_validate_their_fields():
    with pytest.raises(ValueError, match="state must be one of .* got 'gone'"):
        make_worker(state="gone")
    with pytest.raises(ValueError, match="block_size must be >= 1, got 0"):
        dataclasses.replace(make_worker(), block_size=0)
    with pytest.raises(ValueError, match="got 'running'"):
        make_request(state="running")
    with pytest.raises(ValueError, match="num_reserved_blocks must be >= 0, got -1"):
        make_request(num_reserved_blocks=-1)
    with pytest.raises(ValueError, match="worker_id must be None or non-empty"):
        make_request(worker_id="")


def test_state_survives_a_redis_restart_and_the_store_keeps_working(server, store):
    store.put_worker(make_worker("w0"))
    placed = make_request("r0", worker_id="w0", state="placed", num_reserved_blocks=6)
    store.put_request(placed)
    store.incr("migrations")
    server.restart()
    assert store.ping()
    assert store.workers() == [make_worker("w0")]
    assert store.get_request("r0") == placed
    assert store.reserved_blocks_by_worker() == {"w0": 6}
    assert store.counters() == {"migrations": 1}
    store.put_request(dataclasses.replace(placed, state="finished"))
    assert store.requests("finished")[0].request_id == "r0"


def test_ping_is_false_when_redis_is_gone(tmp_path):
    with EmbeddedRedis(tmp_path) as embedded:
        store = ControllerStore(connect(embedded.url, max_retry_s=0.2))
        assert store.ping()
    assert not store.ping()


def test_bytes_client_works_too(server, store):
    raw = ControllerStore(redis.Redis.from_url(server.url))
    raw.put_request(make_request("r0", worker_id="w0", state="placed", num_reserved_blocks=2))
    assert store.get_request("r0") == raw.get_request("r0")
    assert raw.reserved_blocks_by_worker() == {"w0": 2}


def test_concurrent_writers_never_leave_indices_inconsistent(server, store):
    states = ("pending", "placed", "finished", "cancelled")

    def churn(seed: int) -> None:
        rng = random.Random(seed)
        writer = ControllerStore(connect(server.url))
        for _ in range(150):
            state = rng.choice(states)
            worker_id = rng.choice(["w0", "w1", "w2"]) if state == "placed" else None
            writer.put_request(make_request(f"r{rng.randint(0, 2)}", worker_id=worker_id, state=state,
                                            num_reserved_blocks=rng.randint(0, 9)))

    threads = [threading.Thread(target=churn, args=(seed,)) for seed in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    records = store.requests()
    assert sorted(r.request_id for r in records) == ["r0", "r1", "r2"]
    for state in states:
        assert {r.request_id for r in store.requests(state)} == {r.request_id for r in records if r.state == state}
    for worker_id in ("w0", "w1", "w2"):
        assert {r.request_id for r in store.requests_on(worker_id)} == {
            r.request_id for r in records if r.worker_id == worker_id}
    expected: dict[str, int] = {}
    for r in records:
        if r.state == "placed":
            expected[r.worker_id] = expected.get(r.worker_id, 0) + r.num_reserved_blocks
    assert store.reserved_blocks_by_worker() == expected
