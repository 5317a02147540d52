"""WorkerActor on a real local Ray, tiny model: streaming, bad input, abort, moves through the object store, death."""

import asyncio
import random
import re
import time

import pytest
import ray
import torch

from workers.actors.worker_actor import WorkerActor, build_engine
from workers.actors.worker_settings import WorkerSettings
from workers.engine.engine_loop import WorkEvent, WorkRequest
from workers.engine.tensor_parallel import LeadRunner
from workers.values.sampling_params import SamplingParams

pytestmark = pytest.mark.xdist_group("ray")  # `make test`: one Ray cluster at a time

BLOCK_SIZE = 4
BYTES_PER_BLOCK = 2 * 2 * BLOCK_SIZE * 2 * 16 * 4
SETTINGS = WorkerSettings.of(
    tiny_model_seed=0,
    tiny_model_init_std=0.2,  # tokens depend on the whole context, so wrong KV would show
    policy="paged_greedy",
    kv_cache_memory=128 * BYTES_PER_BLOCK,
    block_size=BLOCK_SIZE,
    max_num_seqs=4,
    max_num_batched_tokens=16,
    max_model_len=512,
    num_torch_threads=1,
    dtype="float32",  # BYTES_PER_BLOCK counts 4-byte elements
)
TIMEOUT_S = 120


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def local_engine():
    """The same engine in this process, for the expected greedy tokens."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield build_engine(SETTINGS)
    torch.set_num_threads(num_threads)


@pytest.fixture
def start_worker(ray_cluster):
    handles = []

    def start(worker_id: str):
        handle = ray.remote(WorkerActor).options(num_cpus=0.5, max_restarts=0).remote(worker_id, SETTINGS)
        ray.get(handle.ready.remote(), timeout=TIMEOUT_S)
        handles.append(handle)
        return handle

    yield start
    for handle in handles:
        ray.kill(handle)


def make_request(request_id: str, num_prompt_tokens: int, max_tokens: int, seed: int, **kwargs) -> WorkRequest:
    rng = random.Random(seed)
    prompt = tuple(rng.randrange(256) for _ in range(num_prompt_tokens))
    return WorkRequest(request_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), **kwargs)


def expected_tokens(engine, request: WorkRequest) -> list[int]:
    return engine.generate([list(request.prompt_token_ids)], request.params)[0]


def tokens_of(events: list[WorkEvent]) -> list[int]:
    return [token for event in events for token in event.token_ids]


async def collect(handle, request: WorkRequest) -> list[WorkEvent]:
    return [await ref async for ref in handle.generate.remote(request)]


def test_concurrent_streams_and_stats(start_worker, local_engine):
    worker = start_worker("w0")
    requests = [make_request(f"r{i}", 4 + 5 * i, 8 + 4 * i, seed=i) for i in range(3)]

    async def main():
        return await asyncio.wait_for(asyncio.gather(*(collect(worker, r) for r in requests)), TIMEOUT_S)

    results = asyncio.run(main())
    for request, events in zip(requests, results):
        assert tokens_of(events) == expected_tokens(local_engine, request)
        assert events[-1].finish_reason == "length" and events[-1].num_output_tokens == request.params.max_tokens
        assert events[-1].metrics.num_generated_tokens == request.params.max_tokens
    stats = ray.get(worker.stats.remote(), timeout=TIMEOUT_S)
    assert stats.worker_id == "w0" and stats.request_ids == ()
    assert stats.num_free_blocks == stats.num_total_blocks == 128
    assert stats.num_generated_tokens == sum(r.params.max_tokens for r in requests)


def test_a_refused_request_raises_value_error_at_the_caller(start_worker, local_engine):
    worker = start_worker("w0")
    stream = worker.generate.remote(make_request("too-long", 500, 100, seed=10))
    with pytest.raises(ValueError, match="exceeds the context of 512 tokens"):
        ray.get(next(stream), timeout=TIMEOUT_S)
    good = make_request("good", 5, 6, seed=11)
    events = [ray.get(ref, timeout=TIMEOUT_S) for ref in worker.generate.remote(good)]
    assert tokens_of(events) == expected_tokens(local_engine, good)


def test_abort_ends_the_stream_and_frees_blocks(start_worker):
    worker = start_worker("w0")
    stream = worker.generate.remote(make_request("a", 7, 400, seed=20))
    first = ray.get(next(stream), timeout=TIMEOUT_S)
    assert first.finish_reason is None
    assert ray.get(worker.abort.remote("a"), timeout=TIMEOUT_S)
    rest = [ray.get(ref, timeout=TIMEOUT_S) for ref in stream]
    assert rest[-1].finish_reason == "abort" and rest[-1].num_output_tokens < 400
    stats = ray.get(worker.stats.remote(), timeout=TIMEOUT_S)
    assert stats.request_ids == () and stats.num_free_blocks == stats.num_total_blocks
    assert not ray.get(worker.abort.remote("a"), timeout=TIMEOUT_S)


def test_a_sequence_moved_with_its_kv_continues_with_the_same_greedy_tokens(start_worker, local_engine):
    """The KV goes worker to worker through the object store: the caller (a router) only holds the ref."""
    source, target = start_worker("wa"), start_worker("wb")
    request = make_request("m", 9, 400, seed=30)  # long enough to be mid-answer when move_out arrives
    stream = source.generate.remote(request)
    before = [ray.get(next(stream), timeout=TIMEOUT_S), ray.get(next(stream), timeout=TIMEOUT_S)]
    assert ray.get(source.move_out.remote("m", "wb", True), timeout=TIMEOUT_S)
    before += [ray.get(ref, timeout=TIMEOUT_S) for ref in stream]
    moved = before[-1]
    sent = tokens_of(before)
    assert (moved.finish_reason, moved.moved_to) == ("moved", "wb") and len(sent) < 400
    assert isinstance(moved.kv, ray.ObjectRef)  # a handle, not tensors
    assert ray.get(moved.kv, timeout=TIMEOUT_S).num_computed_tokens == 9 + len(sent) - 1
    resumed = WorkRequest("m", request.prompt_token_ids, request.params, resumed_output_token_ids=tuple(sent),
                          kv=moved.kv)  # the ref itself: the target fetches the bytes from the source
    after = [ray.get(ref, timeout=TIMEOUT_S) for ref in target.generate.remote(resumed)]
    assert sent + tokens_of(after) == expected_tokens(local_engine, request)
    source_stats, target_stats = ray.get([source.stats.remote(), target.stats.remote()], timeout=TIMEOUT_S)
    assert source_stats.num_migrated_out == 1 and target_stats.num_migrated_in == 1
    assert source_stats.num_free_blocks == source_stats.num_total_blocks


def test_killing_the_actor_mid_stream_raises_actor_died_at_the_consumer(start_worker):
    worker = start_worker("w0")
    request = make_request("k", 5, 500, seed=40)

    async def main():
        events = []
        with pytest.raises(ray.exceptions.RayActorError):
            async for ref in worker.generate.remote(request):
                events.append(await ref)
                if len(events) == 1:
                    ray.kill(worker)
        return events

    events = asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))
    assert events and all(event.finish_reason is None for event in events)


def _two_rank_backend():
    """Workers started as the service starts them (named "s3-worker-<id>" in "s3-tp-test"), each over two ranks
    of half a CPU."""
    from dataclasses import replace

    from cluster.control.worker_pool import RayWorkerBackend

    settings = SETTINGS.updated(tensor_parallel_size=2)
    return RayWorkerBackend(lambda: settings, 0.5, 0.0, "s3-tp-test", lambda worker_id: f"s3-worker-{worker_id}")


@pytest.mark.slow
def test_a_tensor_parallel_worker_runs_its_ranks_in_one_placement_group(ray_cluster, local_engine):
    """Started as the service starts workers: a placement group of two bundles, the worker actor rank 0 in
    the first, a follower rank in the second; gloo between them, DeepSpeed AutoTP in each."""
    from ray.util.placement_group import get_placement_group

    from workers.actors.rank_group import rank_group_name

    backend = _two_rank_backend()
    handle = backend.start("tp")
    try:
        stats = ray.get(handle.ready.remote(), timeout=TIMEOUT_S)
        group = get_placement_group(rank_group_name("s3-worker-tp"))
        assert [bundle["CPU"] for bundle in group.bundle_specs] == [0.5, 0.5]
        # Each rank holds half the KV heads, so the same bytes per rank hold twice the blocks.
        assert stats.num_total_blocks == 2 * 128
        requests = [make_request(f"t{i}", 6 + 9 * i, 10 + 5 * i, seed=40 + i) for i in range(3)]

        async def main():
            return await asyncio.wait_for(asyncio.gather(*(collect(handle, r) for r in requests)), TIMEOUT_S)

        for request, events in zip(requests, asyncio.run(main())):
            assert tokens_of(events) == expected_tokens(local_engine, request)
        ray.get(handle.close.remote(), timeout=TIMEOUT_S)  # the follower's run returns
    finally:
        backend.kill("tp", handle)
    with pytest.raises(ValueError):
        get_placement_group(rank_group_name("s3-worker-tp"))  # removed with the worker


@pytest.mark.slow
def test_a_tensor_parallel_worker_whose_follower_dies_fails_its_stats_poll_naming_the_rank(ray_cluster):
    """The controller's stats poll is what finds dead workers: once a follower rank has died, the worker's
    stats call fails (so its requests are requeued and it is replaced) instead of answering while every
    step it runs waits for the missing rank."""
    from workers.actors.rank_group import follower_name

    backend = _two_rank_backend()
    handle = backend.start("tpdead")
    try:
        ray.get(handle.ready.remote(), timeout=TIMEOUT_S)
        assert ray.get(handle.stats.remote(), timeout=TIMEOUT_S).num_total_blocks == 2 * 128  # both ranks follow
        ray.kill(ray.get_actor(follower_name("s3-worker-tpdead", 1), namespace="s3-tp-test"), no_restart=True)
        deadline_s = time.monotonic() + 60
        while True:
            try:
                ray.get(handle.stats.remote(), timeout=TIMEOUT_S)
            except ray.exceptions.RayTaskError as error:
                assert "worker tpdead: follower rank 1 died" in str(error)
                break
            assert time.monotonic() < deadline_s, "the worker kept answering stats with a dead follower"
            time.sleep(0.5)
    finally:
        backend.kill("tpdead", handle)


@pytest.mark.slow
def test_a_worker_started_as_the_service_starts_it_reads_with_the_probe_it_names(ray_cluster, tmp_path,
                                                                                synthetic_probe_features):
    """The controller hands each worker the cluster's probe loader (the workers import no predictor): a worker
    whose settings name a probe folder loads it in its own process and re-bounds its sequences with it."""
    from dataclasses import replace

    from cluster.control.worker_pool import RayWorkerBackend
    from predictor_service.hidden_probe import HiddenStateProbe, ProbeConfig

    probe = HiddenStateProbe(ProbeConfig(max_len=512, hidden_units=0, num_epochs=1, interval_tokens=4),
                             hidden_size=96).fit(synthetic_probe_features(30, 96, seed=3))  # the tiny model's width
    settings = replace(SETTINGS, policy="s3_peak", length_probe=str(probe.save(tmp_path / "probe")))
    backend = RayWorkerBackend(lambda: settings, 0.5, 0.0, "s3-probe-test", lambda worker_id: f"s3-worker-{worker_id}")
    handle = backend.start("probe")
    try:
        assert ray.get(handle.ready.remote(), timeout=TIMEOUT_S).num_probe_reads == 0
        request = make_request("p", 6, 9, seed=50, predicted_output_tokens=9)
        events = asyncio.run(asyncio.wait_for(collect(handle, request), TIMEOUT_S))
        assert len(tokens_of(events)) == 9
        assert ray.get(handle.stats.remote(), timeout=TIMEOUT_S).num_probe_reads == 3  # after prefill, at 4 and 8
    finally:
        backend.kill("probe", handle)


def _held_lead_runner(runner=None) -> LeadRunner:
    """A `LeadRunner` over `runner` in no process group: `_local` calls run here, as on rank 0."""
    lead = object.__new__(LeadRunner)
    lead.runner, lead.broken, lead.in_call, lead.closed, lead.num_calls_sent = runner, None, None, False, 0
    return lead


def test_a_lead_rank_is_inside_a_shared_call_from_sending_it_until_it_returns(monkeypatch):
    from types import SimpleNamespace

    import workers.engine.tensor_parallel as tensor_parallel

    seen = {}

    def swap_out(seq_id: str, block_ids: list[int]) -> int:
        seen["in_call"] = lead.in_call[0]  # rank 0's own share of the call: the followers make theirs meanwhile
        return 3

    lead = _held_lead_runner(SimpleNamespace(swap_out=swap_out))
    monkeypatch.setattr(tensor_parallel, "_broadcast", lambda call: seen.setdefault("sent", call))
    assert lead.swap_out("a", [1, 2]) == 3
    assert seen == {"sent": ("swap_out", ("a", [1, 2])), "in_call": "swap_out"} and lead.in_call is None

    def fail(call):
        raise RuntimeError("connection reset")

    monkeypatch.setattr(tensor_parallel, "_broadcast", fail)
    with pytest.raises(RuntimeError, match="connection reset"):
        lead.swap_out("a", [1, 2])
    assert lead.in_call is None and lead.broken == "sending swap_out: RuntimeError: connection reset"


def test_a_lead_rank_held_inside_a_shared_call_reports_the_call_after_the_limit():
    import threading

    runner, release = _held_lead_runner(), threading.Event()
    runner.in_call = ("forward", time.monotonic())  # as `_send` leaves it: the followers were sent the call
    step = threading.Thread(target=runner._local, args=(release.wait,))  # a collective a hung rank never joins
    step.start()
    try:
        assert runner.stalled(after_s=60.0) is None  # a slow step is not a hang
        time.sleep(0.2)
        assert re.fullmatch(r"rank 0 has waited \d+ s in forward for the other ranks", runner.stalled(after_s=0.1))
    finally:
        release.set()
        step.join()
    assert runner.in_call is None and runner.stalled(after_s=0.0) is None and runner.broken is None


def test_rank_failure_names_a_follower_that_ended_and_a_lead_rank_out_of_step(ray_cluster):
    """What the stats poll reports, for the ways a tensor-parallel engine stops being able to step."""
    from types import SimpleNamespace

    @ray.remote(num_cpus=0.1)
    def follow(num_calls: int, wait_s: float) -> int:
        time.sleep(wait_s)
        return num_calls

    worker = object.__new__(WorkerActor)  # the state stats() reads, without loading ranks
    worker._closed, worker._engine, worker._rank_stall_s = False, SimpleNamespace(runner=_held_lead_runner()), 30.0
    still_following = follow.remote(0, 600)
    try:
        worker._followers = [(None, still_following)]
        assert worker._rank_failure() is None
        worker._engine.runner.broken = "RuntimeError: boom"
        assert worker._rank_failure() == "rank 0 failed a call the followers made (RuntimeError: boom)"
        worker._closed = True  # after close() the followers return on purpose
        assert worker._rank_failure() is None
        worker._closed, worker._engine.runner.broken = False, None
        stopped = follow.remote(7, 0)
        ray.wait([stopped], timeout=TIMEOUT_S)
        worker._followers = [(None, still_following), (None, stopped)]
        assert worker._rank_failure() == "follower rank 2 stopped after 7 calls"
        worker._followers = [(None, still_following)]
        worker._engine.runner.in_call = ("swap_out", time.monotonic() - 31.0)  # held past rank_stall_s
        assert worker._rank_failure() == "rank 0 has waited 31 s in swap_out for the other ranks"
    finally:
        ray.cancel(still_following, force=True)
