"""The control plane's logic, as plain asyncio code: placement, release, failover, rebalancing, scaling.

`cluster.control.controller.Controller` (the Ray actor) wraps one `ControlPlane`;
`bench control-plane` runs one in-process over simulated workers. Every decision is a
pure function (`placement`, `rebalance`, `scaling`, the policy's `placement_tokens`); this class moves
data between them, the ledger, the worker pool and Redis, and never blocks its loop:

    router --place()--> ledger (memory) --prefix, else `routing`--> Placement  one Redis write
                        (no room, or with late binding no worker that can start it now: wait in
                         `waiting`, in the policy's order, placed as releases and stats open room:
                         `placement.first_fit_decreasing`, `WorkerRooms`, `routing.LeastWorkChooser`)
    router --finish()-> ledger.remove + counter + training sample            one Redis round trip
    run(): every stats_interval_s
        poll stats --no answer--> requeue its requests (the routers re-place them), replace it
                   --overrun----> plan its next bound, migration_target --> source.move_out(target)   `Mover`
                   --imbalance--> choose_rebalance: busiest worker's newest request --> source.move_out(idlest)
                   --rebounded--> re-plan reservations by the bounds the workers' probes refined
                   --load-------> ScalingPolicy --> start or retire workers
        every 10 s: reconcile ledger entries no router or worker will release
        Redis restarted or a write failed: write memory back (`StoreResync`)
"""

import asyncio
import logging
import time
from dataclasses import dataclass, replace

import redis

from cluster.config import ServiceConfig
from cluster.control.ledger import Ledger
from cluster.control.messages import (ClusterStatus, Placement, PlacementTimeoutError, QueueFullError, RequestOutcome,
                                      RequestRecord)
from cluster.control.affinity import Affinity
from cluster.control.placement import PendingRequest, blocks_for, chooses_by_work, first_fit_decreasing
from cluster.control.mover import Mover
from cluster.control.rebound import rebounded_records
from cluster.control.routing import LeastWorkChooser, expected_tokens, live_work_by_worker, route_among
from cluster.control.scaling import ScalingPolicy
from cluster.control.store import ControllerStore
from cluster.control.store_resync import StoreResync
from cluster.control.worker_pool import WorkerBackend, WorkerPool
from cluster.control.worker_rooms import WorkerRooms
from predictor_service.sample_stream import DEFAULT_STREAM_KEY, TrainingSample, sample_fields
from workers.scheduling.policies import make_rule
from workers.values.work_types import WorkerStats

logger = logging.getLogger(__name__)

RECONCILE_INTERVAL_S = 10.0
RECONCILE_GRACE_S = 30.0  # a just-placed request may not have reached its worker yet
SAMPLES_MAX_ENTRIES = 100_000


@dataclass(slots=True)
class _Waiting:
    request: PendingRequest
    future: asyncio.Future
    record: RequestRecord


class ControlPlane:
    """Cluster-wide placement over a pool of workers (see the module docstring).

    Args:
        config: the service's settings.
        store: the Redis state (ledger, workers, counters).
        backend: how workers are started and reached.
        health_store: a store whose client gives up quickly, for /health (default: `store`).
    """

    def __init__(self, config: ServiceConfig, store: ControllerStore, backend: WorkerBackend,
                 health_store: ControllerStore | None = None) -> None:
        self.store = store
        self.health_store = health_store or store
        self.ledger = Ledger(store, on_change=lambda worker_id: self.rooms.refresh(worker_id))
        self.pool = WorkerPool(backend, store, config.block_size, on_ready=self._worker_ready)
        self.rooms = WorkerRooms(self.ledger, self.pool, config.max_num_seqs, config.late_binding)
        self.resync = StoreResync(store, self.ledger, self.pool)
        self.waiting: dict[str, _Waiting] = {}
        self.mover = Mover(self.ledger, self.pool, self._incr)
        self.counters: dict[str, int] = {}
        self._placed_s: dict[str, float] = {}  # request id -> when this controller placed it
        self.affinity = Affinity(self.ledger, self.rooms, self.pool.latest)
        self._last_reconcile_s = time.monotonic()
        self._idle_since_s = time.monotonic()
        self._tasks: set[asyncio.Task] = set()
        self.adopt(config)

    def adopt(self, config: ServiceConfig) -> None:
        """Plan with `config` from now on (running workers keep their engine settings)."""
        self.config = config
        self.rooms.configure(config.max_num_seqs, config.late_binding)
        self.rooms.refresh_all()
        self.policy = make_rule(config.policy, max_model_len=config.max_model_len)  # the workers' planning rule
        self.scaling = ScalingPolicy(config.min_workers_resolved, config.max_workers_resolved,
                                     config.scale_up_queue_depth, config.scale_down_idle_s)

    async def start(self) -> None:
        """Rebuild from Redis (ledger, workers, counters), then start the workers that are missing."""
        await self.ledger.load()
        for worker_id in await self.pool.recover():
            await self._worker_died(worker_id)
        self.counters = await self.store.counters()
        await self.resync.check(self.counters)
        await self._replace_missing_workers()

    async def run(self) -> None:
        """The loop: one tick every stats_interval_s, forever; a failed tick (Redis restarting) is logged."""
        while True:
            try:
                await self.tick()
            except Exception:  # noqa: BLE001 - the loop must outlive a bad tick
                logger.exception("controller tick failed")
            await asyncio.sleep(self.config.stats_interval_s)

    # -- placement -----------------------------------------------------------------------

    async def place(self, request_id: str, num_prompt_tokens: int, max_tokens: int,
                    predicted_output_tokens: int | None, num_resumed_tokens: int = 0,
                    exclude_worker_id: str | None = None, priority: int = 0,
                    prefix_hashes: tuple[int, ...] = (), sibling_of: str | None = None) -> Placement:
        """Reserve KV for a request on a worker (waiting for room); idempotent per request id.

        `exclude_worker_id`: the worker a router lost the request's stream from; the request is
        re-placed elsewhere when it fits at once (after checking whether that worker is gone).
        `priority`: the request's class; while requests wait for room, more urgent ones go first.
        `prefix_hashes`: the prompt's chained block hashes; with nobody waiting, the request goes
        where its longest prefix is cached unless that worker is much fuller (`prefix_affinity`).
        `sibling_of`: a request of the same prompt placed before (a choice of one `n`); with nobody waiting, this
        one goes to the same worker when it has room there, to share the prompt's KV blocks.
        """
        existing = self.ledger.get(request_id)
        if (existing is not None and existing.state == "placed" and existing.worker_id in self.pool.handles
                and existing.worker_id != exclude_worker_id):
            return Placement(request_id, existing.worker_id, self.pool.backend.actor_name(existing.worker_id),
                             existing.num_reserved_blocks)
        if exclude_worker_id is not None and await self.report_failure(exclude_worker_id):
            current = self.ledger.get(request_id)
            if current is not None and current.state == "placed" and current.worker_id == exclude_worker_id:
                # the tick was handling that death and had not read the dead worker's requests yet: this
                # re-placement is the request's requeue, which the tick will no longer find
                await self._incr("requeues", 1)
        if request_id not in self.waiting and len(self.waiting) >= self.config.max_pending_placements:
            raise QueueFullError(f"{len(self.waiting)} requests already wait for a worker with room")
        tokens = self.policy.placement_tokens(num_prompt_tokens, num_resumed_tokens, max_tokens,
                                              predicted_output_tokens)
        num_blocks = blocks_for(tokens, self.config.block_size)
        largest = self.pool.largest_cache_blocks or num_blocks
        num_blocks = max(1, min(num_blocks, largest))  # the worker's own policy copes with the rest
        attempts = existing.num_attempts + 1 if existing is not None else 1
        record = RequestRecord(request_id, None, num_prompt_tokens, max_tokens, predicted_output_tokens or 0,
                               num_blocks, "pending", attempts, time.time())
        expected = expected_tokens(record)
        pending = PendingRequest.under(self.policy, request_id, num_blocks, time.monotonic(), expected, priority)
        if not self.waiting:  # fast path: nobody queued ahead, one write if it fits now
            worker_id = (self.affinity.target(sibling_of, prefix_hashes if self.config.prefix_aware_placement else (),
                                              num_blocks, exclude_worker_id)
                         or route_among(self.config.routing, num_blocks, expected, exclude_worker_id,
                                        self.rooms, self.ledger.records, self.pool.latest))
            if worker_id is not None:
                placed = replace(record, worker_id=worker_id, state="placed")
                await self.ledger.put(placed)
                return self._placement(placed, queued_s=0.0)
        await self.ledger.put(record)
        waiting = self.waiting.get(request_id)
        if waiting is None:
            waiting = _Waiting(pending, asyncio.get_running_loop().create_future(), record)
            self.waiting[request_id] = waiting
        await self._place_waiting()
        try:
            return await asyncio.wait_for(asyncio.shield(waiting.future), self.config.placement_timeout_s)
        except asyncio.TimeoutError:
            if self.waiting.pop(request_id, None) is not None:
                await self.ledger.remove(request_id)
            raise PlacementTimeoutError(
                f"no worker had {num_blocks} free KV blocks" + (" and a free place" if self.config.late_binding else "")
                + f" within {self.config.placement_timeout_s:.0f} s") from None

    def _placement(self, record: RequestRecord, queued_s: float) -> Placement:
        self._placed_s[record.request_id] = time.monotonic()
        return Placement(record.request_id, record.worker_id, self.pool.backend.actor_name(record.worker_id),
                         record.num_reserved_blocks, queued_s)

    async def _place_waiting(self) -> None:
        """Place what waits and now fits. The choice and its reservations happen before the first await,
        so concurrent calls never promise the same blocks."""
        if not self.waiting:
            return
        pending = [w.request for w in self.waiting.values() if not w.future.done()]
        budgets = self.rooms.budgets()
        choose = None  # first fit on the roomiest, as before late binding
        if chooses_by_work(self.config.late_binding, self.config.routing):
            choose = LeastWorkChooser(live_work_by_worker([b.worker_id for b in budgets], self.ledger.records(),
                                                          self.pool.latest))
        chosen = first_fit_decreasing(pending, budgets, now_s=time.monotonic(),
                                      max_wait_s=self.config.max_queue_wait_s, choose=choose)
        staged = []
        for request_id, worker_id in chosen.items():
            waiting = self.waiting.pop(request_id)
            placed = replace(waiting.record, worker_id=worker_id, state="placed")
            staged.append((waiting, placed, self.ledger.stage(placed)))
        results = await asyncio.gather(*(self.ledger.persist(placed, old) for _, placed, old in staged),
                                       return_exceptions=True)
        for (waiting, placed, _), result in zip(staged, results):
            if waiting.future.done():
                continue  # its caller gave up meanwhile; finish() or reconcile releases it
            if isinstance(result, BaseException):
                waiting.future.set_exception(result)
            else:
                waiting.future.set_result(self._placement(placed, time.monotonic() - waiting.request.arrival_s))

    def _worker_ready(self, worker_id: str) -> None:
        self.rooms.refresh(worker_id)
        task = asyncio.get_running_loop().create_task(self._place_waiting())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def finish(self, request_id: str, outcome: RequestOutcome | None = None) -> None:
        """Release a request's reservation; a completed one becomes a training sample (one Redis round trip)."""
        waiting = self.waiting.pop(request_id, None)
        if waiting is not None and not waiting.future.done():
            waiting.future.cancel()
        self.mover.forget(request_id)
        self._placed_s.pop(request_id, None)
        reason = outcome.finish_reason if outcome is not None else "cancelled"
        stream = None
        if outcome is not None and outcome.num_output_tokens >= 1 and reason in ("stop", "length"):
            sample = TrainingSample(request_id, outcome.prompt_text, outcome.num_prompt_tokens, outcome.max_tokens,
                                    outcome.temperature, outcome.num_output_tokens, outcome.predicted_output_tokens)
            stream = (DEFAULT_STREAM_KEY, sample_fields(sample), SAMPLES_MAX_ENTRIES)
        counter = f"finished_{reason}"
        if await self.ledger.remove(request_id, counter=counter, stream=stream) is not None:
            self.counters[counter] = self.counters.get(counter, 0) + 1  # not again for a retried release
        await self._place_waiting()

    async def report_failure(self, worker_id: str) -> bool:
        """A router lost a stream from this worker; True when the worker is indeed gone (its requests requeued)."""
        handle = self.pool.handle(worker_id)
        if handle is None:
            return True
        try:
            await asyncio.wait_for(self.pool.backend.stats(handle), timeout=5.0)
            return False
        except Exception:  # noqa: BLE001 - dead, hung or unreachable all mean replace it
            await self._worker_died(worker_id)
            await self._replace_missing_workers()
            return True

    # -- the loop -----------------------------------------------------------------------

    async def tick(self) -> None:
        try:
            await self.resync.check(self.counters)
        except redis.RedisError as error:  # still down: the workers are polled all the same
            logger.warning("Redis unavailable (%s); %d releases queued", type(error).__name__,
                           self.ledger.num_unwritten)
        # Each phase walks every worker; yielding between them keeps placements from waiting behind all of them.
        previous, failed = await self.pool.poll()
        for worker_id in failed:
            await self._worker_died(worker_id)
        self.rooms.refresh_all()
        await asyncio.sleep(0)
        await self._count_worker_events(previous)
        await self._replace_missing_workers()
        self.mover.settle()
        await asyncio.sleep(0)
        await self.mover.move_overruns(self.policy, self.config.block_size, self.config.migrate_kv_min_tokens)
        await self.mover.rebalance(self.config.rebalance_min_gap, self.rooms.free(),
                                   by_work=self.config.routing == "predicted_work")
        await self._follow_rebounds()
        if time.monotonic() - self._last_reconcile_s >= RECONCILE_INTERVAL_S:
            await self._reconcile()
        await self._place_waiting()
        await asyncio.sleep(0)
        await self._scale()

    async def _worker_died(self, worker_id: str) -> None:
        await self.pool.mark_dead(worker_id)
        self.rooms.remove(worker_id)
        self.affinity.forget(worker_id)
        requeued = 0
        for record in self.ledger.on_worker(worker_id):
            if record.state == "placed":
                await self.ledger.put_or_queue(replace(record, worker_id=None, state="pending"))
                requeued += 1
        if requeued:
            await self._incr("requeues", requeued)
        logger.warning("worker %s is gone; %d in-flight requests requeued", worker_id, requeued)

    async def _replace_missing_workers(self) -> None:
        while self.pool.num_workers < max(self.config.num_workers, self.config.min_workers_resolved) \
                and self.pool.num_workers < self.config.max_workers_resolved:
            await self.pool.start_worker()

    async def _count_worker_events(self, previous: dict[str, WorkerStats | None]) -> None:
        """Workers count since they started; the cluster's totals must survive a worker's death."""
        for worker_id, before in previous.items():
            now = self.pool.latest[worker_id]
            for counter, attr in (("overruns", "num_overruns"), ("preemptions", "num_preemptions")):
                delta = getattr(now, attr) - (getattr(before, attr) if before is not None else 0)
                if delta > 0:
                    await self._incr(counter, delta)

    async def _follow_rebounds(self) -> None:
        """Plan requests by the bounds their workers' length probes refined (`cluster.control.rebound`)."""
        for stats in list(self.pool.latest.values()):
            largest = self.pool.largest_cache_blocks or stats.num_total_blocks
            for record in rebounded_records(stats, self.ledger.get, self.policy.placement_tokens,
                                            self.config.block_size, largest, self.mover.moving):
                try:
                    await self.ledger.put(record)
                except redis.RedisError:
                    return  # memory is put back; the workers report these bounds again next tick

    async def _reconcile(self) -> None:
        """Drop ledger entries nobody will release: a router that died, or a release call that was lost.

        A placed request its worker does not hold, or a pending one no caller waits for, is
        garbage once older than the grace period.
        """
        self._last_reconcile_s = now_s = time.monotonic()
        held = {rid for stats in self.pool.latest.values() for rid in stats.request_ids}
        wall_now_s = time.time()
        for record in self.ledger.records():
            rid = record.request_id
            if record.state == "placed" and record.worker_id in self.pool.latest and rid not in held:
                age_s = now_s - self._placed_s.get(rid, now_s - (wall_now_s - record.created_s))
            elif record.state == "pending" and rid not in self.waiting:
                age_s = wall_now_s - record.created_s
            else:
                continue
            if age_s > RECONCILE_GRACE_S and rid not in self.mover.moving:
                self._placed_s.pop(rid, None)
                self.mover.forget(rid)
                await self.ledger.remove(rid, counter="reconciled")
                self.counters["reconciled"] = self.counters.get("reconciled", 0) + 1

    async def _scale(self) -> None:
        pool, ready = self.pool, self.pool.ready_ids()
        if any(pool.latest[w].num_running or pool.latest[w].num_waiting for w in ready) or self.waiting:
            self._idle_since_s = time.monotonic()
        pending_blocks = sum(w.request.num_blocks for w in self.waiting.values())
        num_pending = len(self.waiting)
        if not self.policy.holds_plan:  # charged less than they will hold: their backlog waits in the workers
            num_pending += sum(pool.latest[w].num_waiting for w in ready)
        free = sum(self.rooms.free().values())
        per_worker = max((pool.latest[w].num_total_blocks for w in ready), default=1)
        desired = self.scaling.desired_num_workers(pool.num_workers, num_pending, pending_blocks, free,
                                                   per_worker, time.monotonic() - self._idle_since_s)
        for _ in range(desired - pool.num_workers):
            await pool.start_worker()
        if desired < pool.num_workers:
            idle = [w for w in ready if not pool.latest[w].request_ids]
            for worker_id in idle[: pool.num_workers - desired]:
                logger.info("retiring idle worker %s", worker_id)
                await pool.mark_dead(worker_id)
                self.rooms.remove(worker_id)
                self._idle_since_s = time.monotonic()

    async def _incr(self, counter: str, amount: int = 1) -> None:
        self.counters[counter] = self.counters.get(counter, 0) + amount
        try:
            await self.store.incr(counter, amount)
        except (redis.ConnectionError, redis.TimeoutError):
            self.resync.pending = True  # the next resync raises Redis's count to memory's

    @property
    def moving(self) -> dict[str, str]:
        """Requests on their way to another worker: request id -> target."""
        return self.mover.moving

    # -- status and shutdown -----------------------------------------------------------

    async def status(self) -> ClusterStatus:
        """From memory, plus one PING through the quick-to-give-up client."""
        is_redis_ok = await self.health_store.ping()
        workers = tuple(sorted(self.pool.records.values(), key=lambda r: r.worker_id))
        stats = tuple(self.pool.latest[w] for w in self.pool.ready_ids())
        return ClusterStatus(workers, stats, self.ledger.reserved_by_worker(), len(self.waiting),
                             dict(self.counters), is_redis_ok)

    async def shutdown(self) -> None:
        """Stop every worker (they are detached: nothing else would)."""
        for worker_id in list(self.pool.handles):
            await self.pool.mark_dead(worker_id)
