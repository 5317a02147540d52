"""Cluster-level rebalancing and scaling with the real controller, real workers (SmolLM2), real Redis.

No HTTP here: requests go through `cluster.ingress.generation.run_job`, the path the router uses, with
predicted bounds chosen by the test so that placement is deterministic.
"""

import asyncio
import time

import pytest
import ray

from cluster.config import CONTROLLER_NAME, RAY_NAMESPACE, ServiceConfig, worker_actor_name
from cluster.control.controller import get_or_create_controller
from cluster.control.redis_server import EmbeddedRedis
from cluster.ingress.generation import GenerationJob, GenerationResult, WorkerHandles, run_job
from workers.engine.models import chat_token_ids
from workers.values.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

BLOCK_SIZE = 16
BYTES_PER_BLOCK = 30 * 2 * 3 * 64 * 4 * BLOCK_SIZE  # SmolLM2-135M: 30 layers, K and V, 3 KV heads, head_dim 64, fp32
NUM_BLOCKS = 16  # per worker: 256 tokens


def _config(model_cache_dir, **fields) -> ServiceConfig:
    # The scenarios are built on s3's whole reservations, placed by room and rebalanced by counts (the defaults
    # when they were written), with the bounds they set kept (no length probe re-bounding them); the default
    # policy, routing and probe have their own tests.
    base = dict(model_cache_dir=str(model_cache_dir), kv_cache_memory=NUM_BLOCKS * BYTES_PER_BLOCK,
                block_size=BLOCK_SIZE, max_model_len=256, default_max_tokens=64, num_torch_threads=1,
                stats_interval_s=0.2, migrate_kv_min_tokens=0, dtype="float32",  # the block arithmetic above is fp32
                policy="s3", routing="room", length_probe="none")
    base.update(fields)
    return ServiceConfig(**base)


@pytest.fixture
def cluster(tmp_path):
    ray.init(num_cpus=8, namespace=RAY_NAMESPACE, include_dashboard=False, logging_level="WARNING")
    redis = EmbeddedRedis(tmp_path / "redis")
    url = redis.start()
    yield url
    try:
        controller = ray.get_actor(CONTROLLER_NAME, namespace=RAY_NAMESPACE)
        ray.get(controller.shutdown.remote(), timeout=30)
    finally:
        ray.shutdown()
        redis.stop()


def _prompt(tokenizer, text: str) -> tuple[int, ...]:
    return tuple(chat_token_ids(tokenizer, [{"role": "user", "content": text}]))


async def _run(controller, job: GenerationJob, handles: WorkerHandles | None = None) -> GenerationResult:
    result = GenerationResult([])
    async for _ in run_job(job, controller, handles or WorkerHandles(), result, worker_actor_name):
        pass
    return result


class _KillsTheSourceAsTheKVMoves(WorkerHandles):
    """One request's worker handles, as the router asks for them: when it asks for the worker a move sends the
    request to, the worker it came from is killed first, so the KV the target then fetches has lost its owner."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[str] = []

    def get(self, worker_id: str, actor_name: str):
        self.asked.append(worker_id)
        if len(self.asked) == 2 and self.asked[0] != worker_id:
            source = super().get(self.asked[0], worker_actor_name(self.asked[0]))
            ray.kill(source, no_restart=True)
            deadline = time.monotonic() + 30
            while True:  # dead (its objects lost) before the target asks for the KV
                assert time.monotonic() < deadline, "the killed source still answers"
                try:
                    ray.get(source.__ray_ready__.remote(), timeout=5)
                except ray.exceptions.RayActorError:
                    time.sleep(2.0)  # and the raylet has dropped what it kept for it (else the fetch may still win)
                    break
                except ray.exceptions.GetTimeoutError:
                    pass
        return super().get(worker_id, actor_name)


def _job(request_id: str, prompt, num_output_tokens: int, predicted: int) -> GenerationJob:
    params = SamplingParams(max_tokens=num_output_tokens, temperature=0.0, ignore_eos=True)
    return GenerationJob(request_id, "", prompt, params, predicted, predicted)


def _wait_ready(controller, num_workers: int, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if len(ray.get(controller.status.remote()).stats) >= num_workers:
            return
        time.sleep(0.5)
    pytest.fail(f"{num_workers} workers did not become ready")


def test_overrun_moves_to_the_worker_with_room_and_output_is_unchanged(cluster, model_cache_dir, smollm2_tokenizer):
    controller = get_or_create_controller(_config(model_cache_dir, num_workers=2), cluster)
    _wait_ready(controller, 2)
    prompt = _prompt(smollm2_tokenizer, "Write a long story about a lighthouse keeper.")
    # Bounds chosen so reservations are exact block counts: 13 + 3 blocks fill a worker.
    big_bound = 13 * BLOCK_SIZE - len(prompt)
    under_bound = 3 * BLOCK_SIZE - len(prompt)
    assert big_bound >= 160 and under_bound >= 1, f"the scenario needs a short prompt, got {len(prompt)} tokens"

    async def scenario():
        # w1: `big` reserves 13 of 16 blocks and runs long; w2: `blocker` reserves 13 too.
        # `under` takes the last 3 blocks of w1 (tie broken by id) but runs 150 tokens: it outruns
        # on a full w1. Once it waits there, the blocker's client leaves and w2 has room.
        big = asyncio.ensure_future(_run(controller, _job("big", prompt, 160, big_bound)))
        await asyncio.sleep(0.5)
        blocker = asyncio.ensure_future(_run(controller, _job("blocker", prompt, 160, big_bound)))
        await asyncio.sleep(0.5)
        under = asyncio.ensure_future(_run(controller, _job("under", prompt, 150, under_bound)))
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            status = await controller.status.remote()
            if any(r.request_id == "under" for s in status.stats for r in s.overruns):
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError(f"`under` never waited after an overrun: {status}")
        blocker.cancel()
        return await under, await big

    under, big = asyncio.run(scenario())
    assert len(under.output_token_ids) == 150 and under.finish_reason == "length"
    assert under.num_moves >= 1
    assert len(big.output_token_ids) == 160
    status = ray.get(controller.status.remote())
    assert status.counters.get("migrations", 0) >= 1
    assert status.counters.get("overruns", 0) >= 1

    alone = asyncio.run(_run(controller, _job("alone", prompt, 150, big_bound)))
    assert alone.num_moves == 0
    assert under.output_token_ids == alone.output_token_ids  # the KV moved intact


LONG_TOKENS = 300  # seconds of decoding: a rebalancing move comes within a few stats rounds


def _drained_worker(cluster, model_cache_dir, smollm2_tokenizer, handles_of_r2: WorkerHandles | None = None,
                    run_alone: bool = True):
    """Two long answers on w1 and two short ones on w2; once w2 has drained, a rebalance moves w1's newest (r2) to
    it with its KV. Returns the four results, the controller's status and r2's tokens run alone (None without
    `run_alone`)."""
    # paged_greedy plans only the prompt: every request is placed at once, alternating w1 and w2 (roomiest first).
    num_blocks = 48  # per worker: room for both long answers at once
    controller = get_or_create_controller(_config(model_cache_dir, num_workers=2, policy="paged_greedy",
                                                  kv_cache_memory=num_blocks * BYTES_PER_BLOCK, max_model_len=512),
                                          cluster)
    _wait_ready(controller, 2)
    prompt = _prompt(smollm2_tokenizer, "Write a long story about a lighthouse keeper.")
    assert 2 * (len(prompt) + LONG_TOKENS) <= num_blocks * BLOCK_SIZE, "both long answers must fit one worker"

    async def scenario():
        jobs = []
        for index, num_output_tokens in enumerate((LONG_TOKENS, 16, LONG_TOKENS, 16)):  # w1, w2, w1, w2
            handles = handles_of_r2 if index == 2 else None
            jobs.append(asyncio.ensure_future(_run(controller, _job(f"r{index}", prompt, num_output_tokens, 8),
                                                   handles)))
            # Placed in this order, and before the first stats round can show r0's growth on w1: placement
            # counts the larger of the ledger's and the worker's blocks, so a later look could send r2 to w2.
            await asyncio.sleep(0.01)
        return await asyncio.gather(*jobs)

    results = asyncio.run(scenario())
    status = ray.get(controller.status.remote())
    if not run_alone:
        return results, status, None
    alone = asyncio.run(_run(controller, _job("alone", prompt, LONG_TOKENS, 8)))
    assert alone.num_moves == 0
    return results, status, alone.output_token_ids


def test_a_drained_worker_takes_a_live_request_from_the_busy_one_and_output_is_unchanged(
        cluster, model_cache_dir, smollm2_tokenizer):
    results, status, _ = _drained_worker(cluster, model_cache_dir, smollm2_tokenizer, run_alone=False)
    # w2's short answers end at once; w1 still decodes two long ones, so its newest moves to w2 with its KV
    assert [len(r.output_token_ids) for r in results] == [LONG_TOKENS, 16, LONG_TOKENS, 16]
    assert [r.num_moves for r in results] == [0, 0, 1, 0], status
    assert status.counters.get("rebalances", 0) == 1 and status.counters.get("overruns", 0) == 0
    # the KV moved intact: r2 ends as r0 (the same prompt, never moved) does (CI time: no third run alone)
    assert results[2].output_token_ids == results[0].output_token_ids


def test_a_worker_killed_while_its_kv_moves_out_loses_no_token(cluster, model_cache_dir, smollm2_tokenizer):
    """The source dies between handing the request over and the target fetching its KV: the target recomputes it,
    and the source's other long answer fails over; both end as they would alone."""
    handles = _KillsTheSourceAsTheKVMoves()
    results, status, alone = _drained_worker(cluster, model_cache_dir, smollm2_tokenizer, handles)
    assert handles.asked[:2] == ["w1", "w2"], handles.asked  # r2 was moved, and w1 was killed on the way
    assert [len(r.output_token_ids) for r in results] == [LONG_TOKENS, 16, LONG_TOKENS, 16]
    assert results[0].num_failovers == 1 and results[2].num_failovers == 0 and results[2].num_moves == 1
    assert results[0].output_token_ids == results[2].output_token_ids == alone
    assert "w1" not in {s.worker_id for s in status.stats}


def test_queue_grows_the_pool_and_idleness_shrinks_it(cluster, model_cache_dir, smollm2_tokenizer):
    config = _config(model_cache_dir, num_workers=1, min_workers=1, max_workers=2, scale_up_queue_depth=1,
                     scale_down_idle_s=2.0)
    controller = get_or_create_controller(config, cluster)
    _wait_ready(controller, 1)
    prompt = _prompt(smollm2_tokenizer, "Tell me about the moon.")

    async def burst():
        # Each reserves 13 of a worker's 16 blocks: one at a time per worker.
        bound = 13 * BLOCK_SIZE - len(prompt)
        return await asyncio.gather(*(_run(controller, _job(f"r{i}", prompt, 40, bound)) for i in range(4)))

    results = asyncio.run(burst())
    assert [len(r.output_token_ids) for r in results] == [40] * 4
    status = ray.get(controller.status.remote())
    assert {w.worker_id for w in status.workers} >= {"w1", "w2"}  # a second worker was started for the queue
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        ready = [w for w in ray.get(controller.status.remote()).workers if w.state == "ready"]
        if len(ready) == 1:
            break
        time.sleep(0.5)
    else:
        pytest.fail("the idle pool did not shrink back to min_workers")
