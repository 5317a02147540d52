"""The controller's workers: how they are started and reached (a backend), and their lifecycle and latest stats.

    WorkerBackend (abstract)   start / find / kill / ready / stats / move_out
      RayWorkerBackend         detached named `WorkerActor`s (the service)
      (benchmarks.simulated_workers.SimulatedWorkerBackend: in-process, for `bench control-plane`)

    WorkerPool                 handles, latest stats, starting/ready/dead, worker records in Redis

A worker is "ready" once its first stats arrived; placement only ever sees ready
workers. A worker whose stats call fails or times out is dead: the pool kills it
and says so; the control plane requeues its requests and replaces it.
"""

import abc
import asyncio
import logging
import time
from collections.abc import Callable

import redis

from cluster.control.messages import WorkerRecord
from cluster.control.placement import WorkerBudget
from cluster.control.store import ControllerStore
from cluster.control.worker_probe import load_length_probe
from workers.values.work_types import WorkerStats

logger = logging.getLogger(__name__)

POLL_CHUNK = 16  # workers whose stats are requested per event-loop turn (more: longer stalls for placements)
# After the poll's deadline, answers still in flight get this long more: when the controller itself was paused (a
# SIGSTOP, a long GC, a starved host) its deadline passed while the workers' answers waited to be read, and taking
# them for dead replaced healthy workers (`bench chaos`'s stop_controller did, every time).
POLL_GRACE_S = 2.0


class WorkerBackend(abc.ABC):
    """How workers are started, found again, reached and stopped. Handles are opaque to the pool."""

    @abc.abstractmethod
    def actor_name(self, worker_id: str) -> str:
        """The name routers reach the worker by."""

    @abc.abstractmethod
    def start(self, worker_id: str):
        """Start a worker; returns its handle at once (readiness comes from `ready`)."""

    @abc.abstractmethod
    def find(self, worker_id: str, actor_name: str):
        """A live worker started earlier (by a previous controller), or None."""

    @abc.abstractmethod
    def kill(self, worker_id: str, handle) -> None:
        """Stop a worker for good, and free what it held; `handle` is None for a worker already gone."""

    @abc.abstractmethod
    async def ready(self, handle) -> WorkerStats:
        """Wait until the worker serves (its model is loaded); its first stats."""

    @abc.abstractmethod
    async def stats(self, handle) -> WorkerStats:
        """The worker's stats now."""

    @abc.abstractmethod
    async def move_out(self, handle, request_id: str, target_worker_id: str, with_kv: bool) -> bool:
        """Ask the worker to end a request's stream with "moved" (handing its KV on); False if it cannot."""


class RayWorkerBackend(WorkerBackend):
    """Workers as detached, named `WorkerActor`s.

    Args:
        settings: builds the `WorkerSettings` of a new worker (from the config in force).
        num_cpus, num_gpus: what each actor asks Ray for (a GPU makes the autoscaler add a GPU node).
        namespace: the service's Ray namespace.
        name_of: worker id -> actor name.
    """

    def __init__(self, settings: Callable, num_cpus: float, num_gpus: float, namespace: str,
                 name_of: Callable[[str], str]) -> None:
        self._settings = settings
        self._num_cpus = num_cpus
        self._num_gpus = num_gpus
        self._namespace = namespace
        self._name_of = name_of

    def actor_name(self, worker_id: str) -> str:
        return self._name_of(worker_id)

    def start(self, worker_id: str):
        import ray

        from workers.actors.worker_actor import WorkerActor

        settings = self._settings()
        options = {}
        group = None
        if settings.engine.tensor_parallel_size > 1:
            # One node, a bundle per rank; the worker actor is rank 0 in bundle 0 and starts the others.
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            from workers.actors.rank_group import rank_group, rank_group_name

            group = rank_group(rank_group_name(self.actor_name(worker_id)), settings.engine.tensor_parallel_size,
                               self._num_cpus, self._num_gpus)
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0)
        try:
            return ray.remote(WorkerActor).options(
                name=self.actor_name(worker_id), namespace=self._namespace, lifetime="detached",
                num_cpus=self._num_cpus, num_gpus=self._num_gpus, max_restarts=0, max_concurrency=1000, **options,
            ).remote(worker_id, settings, group, self._namespace, load_length_probe)
        except BaseException:
            if group is not None:
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(group)
            raise

    def find(self, worker_id: str, actor_name: str):
        import ray

        try:
            return ray.get_actor(actor_name, namespace=self._namespace)
        except ValueError:
            return None

    def kill(self, worker_id: str, handle) -> None:
        import ray

        from workers.actors.rank_group import rank_group_name, remove_rank_group

        try:
            if handle is not None:
                ray.kill(handle, no_restart=True)
        finally:
            # A tensor-parallel worker's placement group, by name (also one a previous controller created).
            remove_rank_group(rank_group_name(self.actor_name(worker_id)))

    async def ready(self, handle) -> WorkerStats:
        return await handle.ready.remote()

    async def stats(self, handle) -> WorkerStats:
        return await handle.stats.remote()

    async def move_out(self, handle, request_id: str, target_worker_id: str, with_kv: bool) -> bool:
        return await handle.move_out.remote(request_id, target_worker_id, with_kv)


class WorkerPool:
    """Worker handles, their latest stats and their records.

    Args:
        backend: how workers are started and reached.
        store: where worker records are kept.
        block_size: tokens per KV block (records of starting workers).
        on_ready: called with a worker's id when it becomes ready (placement may proceed).
    """

    def __init__(self, backend: WorkerBackend, store: ControllerStore, block_size: int,
                 on_ready: Callable[[str], None] = lambda worker_id: None) -> None:
        self.backend = backend
        self.store = store
        self.block_size = block_size
        self.on_ready = on_ready
        self.handles: dict[str, object] = {}
        self.latest: dict[str, WorkerStats] = {}
        self.records: dict[str, WorkerRecord] = {}
        self._starting: set[str] = set()
        self._tasks: set[asyncio.Task] = set()
        self._largest: int | None = None
        self.needs_sync = False  # a record write failed (Redis down): `sync()` writes them all

    async def recover(self) -> list[str]:
        """Find the live workers a previous controller started; returns the ids of those that are gone."""
        gone = []
        for record in await self.store.workers():
            self.records[record.worker_id] = record
            if record.state == "dead":
                continue
            handle = self.backend.find(record.worker_id, record.actor_name)
            if handle is None:
                gone.append(record.worker_id)
            else:
                self.handles[record.worker_id] = handle
        if self.handles:
            logger.info("recovered %d workers from Redis", len(self.handles))
        return gone

    @property
    def highest_worker_number(self) -> int:
        """The largest N of the worker ids "wN" ever recorded (0 without any): the id counter must stay above it."""
        return max((int(w[1:]) for w in self.records if w[:1] == "w" and w[1:].isdigit()), default=0)

    @property
    def num_workers(self) -> int:
        """Workers running or starting."""
        return len(self.handles)

    def ready_ids(self) -> list[str]:
        return [wid for wid in self.handles if wid not in self._starting and wid in self.latest]

    def is_ready(self, worker_id: str | None) -> bool:
        return worker_id in self.handles and worker_id not in self._starting and worker_id in self.latest

    def handle(self, worker_id: str):
        return self.handles.get(worker_id)

    @property
    def largest_cache_blocks(self) -> int | None:
        """KV blocks of the largest ready worker (None without any)."""
        return self._largest

    def budgets(self, reserved_blocks: Callable[[str], int], exclude: str | None = None) -> list[WorkerBudget]:
        """Ready workers as placement sees them. The ledger reserves at placement, the worker when the
        request arrives (and on-demand policies grow past their plan): the larger of the two counts."""
        budgets = []
        for wid in self.ready_ids():
            if wid == exclude:
                continue
            stats = self.latest[wid]
            held = max(reserved_blocks(wid), stats.num_reserved_blocks)
            budgets.append(WorkerBudget(wid, stats.num_total_blocks, held, True))
        return budgets

    async def start_worker(self) -> str:
        number = await self.store.incr("worker_ids")
        if number <= self.highest_worker_number:  # a restarted Redis lost increments: never reuse an id
            number = self.highest_worker_number + 1
            await self.store.raise_counters({"worker_ids": number})
        worker_id = f"w{number}"
        handle = self.backend.start(worker_id)
        record = WorkerRecord(worker_id, self.backend.actor_name(worker_id), 0, self.block_size, "starting",
                              time.time())
        self.handles[worker_id] = handle
        self._starting.add(worker_id)
        self.records[worker_id] = record
        await self._write(record)
        task = asyncio.get_running_loop().create_task(self._await_ready(worker_id, handle))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        logger.info("starting worker %s", worker_id)
        return worker_id

    async def _await_ready(self, worker_id: str, handle) -> None:
        try:
            stats = await self.backend.ready(handle)
        except Exception:  # noqa: BLE001 - any failure to start means the worker is gone
            if worker_id not in self.handles:
                return  # retired or shut down while it started: killed on purpose
            logger.exception("worker %s failed to start", worker_id)
            self._starting.discard(worker_id)
            await self.mark_dead(worker_id)
            return
        self._starting.discard(worker_id)
        if worker_id not in self.handles:
            return  # retired while it started
        self.latest[worker_id] = stats
        self._largest = max(self._largest or 0, stats.num_total_blocks)
        record = WorkerRecord(worker_id, self.backend.actor_name(worker_id), stats.num_total_blocks,
                              stats.block_size, "ready", time.time())
        self.records[worker_id] = record
        await self._write(record)
        logger.info("worker %s ready: %d KV blocks", worker_id, stats.num_total_blocks)
        self.on_ready(worker_id)

    async def mark_dead(self, worker_id: str) -> bool:
        """Kill and forget a worker, recording it as dead; False when it was already gone."""
        handle = self.handles.pop(worker_id, None)
        self.latest.pop(worker_id, None)
        self._starting.discard(worker_id)
        try:  # also without a handle: a worker found gone may leave resources (a tensor-parallel group)
            self.backend.kill(worker_id, handle)
        except Exception:  # noqa: BLE001 - it may already be dead
            pass
        record = self.records.get(worker_id)
        if record is not None and record.state != "dead":
            dead = WorkerRecord(record.worker_id, record.actor_name, record.num_total_blocks, record.block_size,
                                "dead", record.started_s)
            self.records[worker_id] = dead
            await self._write(dead)
        return handle is not None

    async def sync(self) -> None:
        """Write every worker record (after Redis came back, possibly without its last writes)."""
        self.needs_sync = False  # set again by a write that fails meanwhile
        try:
            for record in list(self.records.values()):
                await self.store.put_worker(record)
        except BaseException:
            self.needs_sync = True
            raise

    async def _write(self, record: WorkerRecord) -> None:
        """Keep the record in Redis; with Redis down the memory is right and `sync()` writes it later."""
        try:
            await self.store.put_worker(record)
        except (redis.ConnectionError, redis.TimeoutError) as error:
            logger.warning("worker record %s not written (%s)", record.worker_id, type(error).__name__)
            self.needs_sync = True

    async def poll(self, timeout_s: float = 10.0) -> tuple[dict[str, WorkerStats], list[str]]:
        """Stats of every started worker: (worker id -> previous stats of those that answered, ids that did not).

        One deadline for the whole poll (not one timer per worker): a hung worker costs `timeout_s` once.
        """
        ids = [wid for wid in self.handles if wid not in self._starting]
        loop = asyncio.get_running_loop()
        tasks = {}
        for start in range(0, len(ids), POLL_CHUNK):
            # A chunk at a time, yielding between chunks: a thousand answers handled in one loop
            # iteration would stall every placement waiting behind them (measured: ~5 ms at 1,024).
            for wid in ids[start:start + POLL_CHUNK]:
                tasks[loop.create_task(self.backend.stats(self.handles[wid]))] = wid
            await asyncio.sleep(0)
        done, pending = await asyncio.wait(tasks, timeout=timeout_s) if tasks else (set(), set())
        if pending:
            late, pending = await asyncio.wait(pending, timeout=POLL_GRACE_S)
            done |= late
        for task in pending:
            task.cancel()
        previous, failed = {}, [tasks[task] for task in pending]
        for task in done:
            wid = tasks[task]
            if task.exception() is not None:
                failed.append(wid)
            elif wid in self.handles:
                previous[wid] = self.latest.get(wid)
                self.latest[wid] = task.result()
        self._largest = max((s.num_total_blocks for s in self.latest.values()), default=None)
        return previous, failed
