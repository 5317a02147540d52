"""After a Redis outage: write the controller's memory back so Redis agrees with it again.

While the controller lives its memory is the truth (the ledger, worker records, counters);
Redis is where a restarted controller finds them. Two things make Redis differ: writes
that failed while it was down (the ledger and the pool queue them), and a restart of
Redis itself, which replays its append-only file but may lose the last second of writes.
`StoreResync.check()`, called from every controller tick, notices both (a failed write,
or a new server run id) and then writes the queue, makes the stored ledger equal to memory,
rewrites the worker records and raises each stored counter to the controller's count.
"""

import logging

from cluster.control.ledger import Ledger
from cluster.control.store import ControllerStore
from cluster.control.worker_pool import WorkerPool

logger = logging.getLogger(__name__)


class StoreResync:
    """Detects a Redis restart or failed writes, and repairs Redis from memory.

    Args:
        store: the controller's Redis state.
        ledger: the request ledger (memory first, Redis second).
        pool: the workers and their records.
    """

    def __init__(self, store: ControllerStore, ledger: Ledger, pool: WorkerPool) -> None:
        self.store = store
        self.ledger = ledger
        self.pool = pool
        self.run_id: str | None = None  # of the Redis server the memory was last written to
        self.num_redis_restarts = 0
        self.pending = False  # a write outside the ledger and the pool failed (a counter): resync anyway

    async def check(self, counters: dict[str, int]) -> bool:
        """Repair Redis if needed (raises a `redis.RedisError` while it is still down); True when repaired."""
        run_id = await self.store.run_id()
        restarted = self.run_id is not None and run_id != self.run_id
        if not (restarted or self.pending or self.ledger.needs_sync or self.pool.needs_sync):
            self.run_id = run_id
            return False
        num_queued = self.ledger.num_unwritten
        self.pending = False
        num_removed, num_written = await self.ledger.sync()
        await self.pool.sync()
        # Worker ids come from a counter only Redis keeps: never hand out one a worker already has.
        await self.store.raise_counters(
            {**counters, "worker_ids": max(counters.get("worker_ids", 0), self.pool.highest_worker_number)})
        if restarted:
            self.num_redis_restarts += 1
        self.run_id = run_id
        logger.warning("Redis %s: wrote %d queued releases, removed %d and rewrote %d ledger entries, "
                       "rewrote %d worker records", "restarted" if restarted else "answers again", num_queued,
                       num_removed, num_written, len(self.pool.records))
        return True
