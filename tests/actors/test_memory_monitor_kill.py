"""A worker killed by Ray's memory monitor, for real: its stream's consumer gets an error the router fails over on.

Ray's memory monitor kills a worker process when the node's memory passes `memory_usage_threshold`; the caller of
the victim's streaming generator then gets `OutOfMemoryError`, which is no `RayActorError`, so a router catching
only that would have failed the request instead of re-placing it (`cluster.ingress.generation.LOST_ACTOR_ERRORS`).
The cluster here sets the threshold 1.5 GiB above the memory in use when it starts, and this process then takes 3
GiB while a tiny-model worker streams.
"""

import asyncio

import numpy as np
import psutil
import pytest
import ray

from cluster.ingress.generation import LOST_ACTOR_ERRORS
from workers.actors.worker_actor import WorkerActor
from workers.actors.worker_settings import WorkerSettings
from workers.engine.engine_loop import WorkRequest
from workers.values.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

HEADROOM_BYTES = 3 * 2**29  # 1.5 GiB
HOG_BYTES = 3 * 2**30
SETTINGS = WorkerSettings.of(tiny_model_seed=0, policy="paged_greedy", kv_cache_memory=2**22, block_size=4,
                          max_num_seqs=4, max_model_len=512, num_torch_threads=1, dtype="float32")


@pytest.fixture
def tight_cluster():
    memory = psutil.virtual_memory()
    if memory.available < HOG_BYTES + 2 * HEADROOM_BYTES:
        pytest.skip(f"needs {(HOG_BYTES + 2 * HEADROOM_BYTES) / 2**30:.1f} GiB free memory")
    threshold = (memory.total - memory.available + HEADROOM_BYTES) / memory.total
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1",
             _system_config={"memory_usage_threshold": threshold, "memory_monitor_refresh_ms": 100})
    try:
        yield
    finally:
        ray.shutdown()


def test_a_worker_the_memory_monitor_kills_mid_stream_is_a_lost_worker_to_the_router(tight_cluster):
    worker = ray.remote(WorkerActor).options(num_cpus=0.5, max_restarts=0).remote("w0", SETTINGS)
    ray.get(worker.ready.remote(), timeout=120)
    request = WorkRequest("oom", tuple(range(3, 11)), SamplingParams(max_tokens=500, ignore_eos=True))

    async def consume():
        events, hog = [], None
        # one event ahead at most: the stream cannot run to its end while the memory monitor takes its time
        stream = worker.generate.options(_generator_backpressure_num_objects=1).remote(request)
        try:
            async for ref in stream:
                events.append(await ref)
                if len(events) == 3:
                    hog = np.ones(HOG_BYTES // 8)  # the node's memory passes the threshold
                    await asyncio.sleep(3.0)  # the monitor looks every 100 ms
        except Exception as error:  # noqa: BLE001 - the assertions below say which
            return events, error, hog is not None
        return events, None, hog is not None

    events, error, hogged = asyncio.run(asyncio.wait_for(consume(), 120))
    assert hogged and events and all(event.finish_reason is None for event in events)
    assert isinstance(error, ray.exceptions.OutOfMemoryError), repr(error)  # the monitor's kill, not another
    assert isinstance(error, LOST_ACTOR_ERRORS)  # so the router re-places the request elsewhere
