"""The control-plane tests' harness: a `ControlPlane` over real embedded Redis and simulated workers."""

import asyncio

from benchmarks.simulated_workers import SimulatedWorkerBackend
from cluster.config import ServiceConfig
from cluster.control.control_plane import ControlPlane
from cluster.control.messages import RequestOutcome
from cluster.control.redis_server import connect, connect_async
from cluster.control.store import ControllerStore

BLOCKS = 10  # per simulated worker
BLOCK_SIZE = 16


def config(**fields) -> ServiceConfig:
    # Room routing and count rebalancing, which these tests were written against; routing by predicted work has
    # its own tests (they set routing="predicted_work").
    base = dict(num_workers=2, block_size=BLOCK_SIZE, policy="s3", max_model_len=1024, placement_timeout_s=5.0,
                max_pending_placements=4, stats_interval_s=0.05, retrain=False, routing="room")
    base.update(fields)
    return ServiceConfig(**base)


def control_plane_runner(url: str):
    """run(check): check(plane, backend) on a started control plane with 2 ready simulated workers, over the
    Redis at `url` (flushed first)."""
    connect(url).flushdb()

    def runner(check, backend=None, **fields):
        async def main():
            sim = backend or SimulatedWorkerBackend(num_total_blocks=BLOCKS, block_size=BLOCK_SIZE)
            client = connect_async(url, max_retry_s=0.3, socket_timeout_s=1.0)
            plane = ControlPlane(config(**fields), ControllerStore(client), sim)
            await plane.start()
            await until(lambda: len(plane.pool.ready_ids()) == plane.config.num_workers)
            try:
                return await check(plane, sim)
            finally:
                await client.aclose()
        return asyncio.run(main())

    return runner


async def until(condition, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


def outcome(n: int = 5) -> RequestOutcome:
    return RequestOutcome("hi", 20, 200, 0.0, n, 40, "stop")
