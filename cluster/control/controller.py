"""The controller: places requests on workers by predicted KV, moves overruns, replaces dead workers.

One named, detached Ray actor (`CONTROLLER_NAME`) restarted by Ray if it dies. Every
durable fact (which worker holds which request with how many reserved blocks, the
workers and their state, counters) lives in Redis through `ControllerStore`, so a
restarted controller rebuilds its view in `__init__` and finds its detached workers
again by name. Decisions come from the pure functions in `cluster.control.placement`; this
class only moves data between Redis, the workers and those functions.

    router --place()--> pending (FFD every change) --> Placement(worker) --> router streams
    loop every stats_interval_s: poll stats --dead?--> requeue its requests, replace it
                                             --overrun?--> migration_target --> worker.move_out
                                             --load?--> ScalingPolicy --> start/retire workers
"""

import asyncio
import logging
import os
import time
from dataclasses import dataclass, replace

import ray

from cluster.config import CONTROLLER_NAME, RAY_NAMESPACE, RETRAINER_NAME, ServiceConfig, worker_actor_name
from cluster.control.placement import (PendingRequest, ScalingPolicy, WorkerBudget, blocks_for, first_fit_decreasing,
                               migration_target)
from cluster.control.redis_server import connect
from cluster.reservation import reservation_tokens
from cluster.control.store import ControllerStore, RequestRecord, WorkerRecord
from predictor_service.retraining import RetrainConfig
from predictor_service.retraining_actor import RetrainerActor
from predictor_service.sample_stream import SampleStream, TrainingSample
from workers.engine_loop import WorkerStats
from workers.worker_actor import WorkerActor, WorkerSettings

logger = logging.getLogger(__name__)

RECONCILE_INTERVAL_S = 10.0
RECONCILE_GRACE_S = 30.0


class QueueFullError(Exception):
    """Too many requests already wait for KV room: the router answers 429."""


class PlacementTimeoutError(Exception):
    """No worker had room within placement_timeout_s: the router answers 503."""


@dataclass(frozen=True, slots=True)
class Placement:
    request_id: str
    worker_id: str
    actor_name: str
    num_reserved_blocks: int
    queued_s: float = 0.0  # time spent waiting for KV room (queueing, not overhead)


@dataclass(frozen=True, slots=True)
class RequestOutcome:
    """What the router saw of a finished request (feeds metrics and retraining)."""

    prompt_text: str
    num_prompt_tokens: int
    max_tokens: int
    temperature: float
    num_output_tokens: int
    predicted_output_tokens: int | None
    finish_reason: str


@dataclass(frozen=True, slots=True)
class ClusterStatus:
    workers: tuple[WorkerRecord, ...]
    stats: tuple[WorkerStats, ...]  # latest poll of each ready worker
    reserved_blocks: dict[str, int]
    num_pending: int
    counters: dict[str, int]
    is_redis_ok: bool


@dataclass(slots=True)
class _Waiting:
    request: PendingRequest
    future: asyncio.Future
    record: RequestRecord


class Controller:
    """Cluster-wide placement over worker actors (see the module docstring).

    Args:
        config: `ServiceConfig.model_dump()`.
        redis_url: the service's Redis.
    """

    def __init__(self, config: dict, redis_url: str) -> None:
        self.config = ServiceConfig(**config)
        self.redis_url = redis_url
        self.redis = connect(redis_url)
        self.store = ControllerStore(self.redis)
        # /health must answer fast while Redis is down; the main client retries for seconds.
        self.health_store = ControllerStore(connect(redis_url, max_retry_s=0.5))
        self.samples = SampleStream(self.redis)
        # Ray restarts an actor with its creation args; the config rolled out since then is in Redis.
        if ray.get_runtime_context().was_current_actor_reconstructed:
            stored = self.redis.get(self._config_key())
            self.config = ServiceConfig.model_validate_json(stored) if stored else self.config
        else:
            self.redis.set(self._config_key(), self.config.model_dump_json())
        self.scaling = ScalingPolicy(self.config.min_workers_resolved, self.config.max_workers_resolved,
                                     self.config.scale_up_queue_depth, self.config.scale_down_idle_s)
        self.handles: dict[str, ray.actor.ActorHandle] = {}
        self.latest: dict[str, WorkerStats] = {}
        self.waiting: dict[str, _Waiting] = {}
        self.moving: set[str] = set()
        self._loop_task: asyncio.Task | None = None
        self._starting: set[str] = set()
        self._idle_since_s = time.monotonic()
        self._placed_s: dict[str, float] = {}  # request id -> when this controller placed it
        self._last_reconcile_s = time.monotonic()
        # worker id -> blocks reserved by placed requests: a mirror of the Redis ledger kept in memory
        # so placement needs no scan of it; rebuilt from Redis on start and at every reconcile.
        self.reserved: dict[str, int] = {}
        self._recover()

    # -- recovery and workers ------------------------------------------------

    def _recover(self) -> None:
        for record in self.store.workers():
            if record.state == "dead":
                continue
            try:
                self.handles[record.worker_id] = ray.get_actor(record.actor_name, namespace=RAY_NAMESPACE)
            except ValueError:
                self._mark_dead(record.worker_id)
        self.reserved = self.store.reserved_blocks_by_worker()
        if self.handles:
            logger.info("controller recovered %d workers from Redis", len(self.handles))

    def _ensure_started(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    def _worker_settings(self) -> WorkerSettings:
        c = self.config
        threads = c.num_torch_threads or max(1, (os.cpu_count() or 1) // c.max_workers_resolved)
        return WorkerSettings(
            model=c.model, model_cache_dir=c.model_cache_dir, policy=c.policy,
            kv_cache_bytes=c.kv_cache_bytes, block_size=c.block_size, max_num_seqs=c.max_num_seqs,
            max_num_batched_tokens=c.max_num_batched_tokens, max_model_len=c.max_model_len,
            num_torch_threads=threads, dtype=c.dtype)

    def _start_worker(self) -> str:
        worker_id = f"w{self.store.incr('worker_ids')}"
        name = worker_actor_name(worker_id)
        handle = ray.remote(WorkerActor).options(
            name=name, namespace=RAY_NAMESPACE, lifetime="detached", num_cpus=self.config.worker_num_cpus,
            num_gpus=self.config.worker_num_gpus, max_restarts=0,
            max_concurrency=1000).remote(worker_id, self._worker_settings())
        self.store.put_worker(WorkerRecord(worker_id, name, 0, self.config.block_size, "starting", time.time()))
        self.handles[worker_id] = handle
        self._starting.add(worker_id)
        asyncio.get_running_loop().create_task(self._await_ready(worker_id, handle))
        logger.info("starting worker %s", worker_id)
        return worker_id

    async def _await_ready(self, worker_id: str, handle) -> None:
        try:
            stats = await handle.ready.remote()
        except Exception:  # noqa: BLE001 - any failure to start means the worker is gone
            logger.exception("worker %s failed to start", worker_id)
            self._starting.discard(worker_id)
            self._mark_dead(worker_id)
            return
        self._starting.discard(worker_id)
        self.latest[worker_id] = stats
        self.store.put_worker(WorkerRecord(worker_id, worker_actor_name(worker_id), stats.num_total_blocks,
                                           stats.block_size, "ready", time.time()))
        logger.info("worker %s ready: %d KV blocks", worker_id, stats.num_total_blocks)
        self._place_waiting()

    def _mark_dead(self, worker_id: str) -> None:
        handle = self.handles.pop(worker_id, None)
        self.latest.pop(worker_id, None)
        if handle is not None:
            ray.kill(handle, no_restart=True)
        for record in self.store.workers():
            if record.worker_id == worker_id and record.state != "dead":
                self.store.put_worker(WorkerRecord(record.worker_id, record.actor_name, record.num_total_blocks,
                                                   record.block_size, "dead", record.started_s))
        requeued = 0
        for request in self.store.requests_on(worker_id):
            if request.state == "placed":
                self.store.put_request(_with(request, worker_id=None, state="pending"))
                requeued += 1
        self.reserved.pop(worker_id, None)
        if requeued:
            self.store.incr("requeues", requeued)
        logger.warning("worker %s is gone; %d in-flight requests requeued", worker_id, requeued)

    def _ready_worker_ids(self) -> list[str]:
        return [wid for wid in self.handles if wid not in self._starting and wid in self.latest]

    def _reserve(self, worker_id: str | None, num_blocks: int) -> None:
        if worker_id is not None:
            self.reserved[worker_id] = max(0, self.reserved.get(worker_id, 0) + num_blocks)

    def _budgets(self) -> list[WorkerBudget]:
        budgets = []
        for wid in self._ready_worker_ids():
            stats = self.latest[wid]
            held = max(self.reserved.get(wid, 0), stats.num_reserved_blocks)
            budgets.append(WorkerBudget(wid, stats.num_total_blocks, held, True))
        return budgets

    # -- placement -------------------------------------------------------------

    async def place(self, request_id: str, num_prompt_tokens: int, max_tokens: int,
                    predicted_output_tokens: int | None, num_resumed_tokens: int = 0,
                    exclude_worker_id: str | None = None) -> Placement:
        """Reserve KV for a request on a worker (waiting for room); idempotent per request id."""
        self._ensure_started()
        existing = self.store.get_request(request_id)
        if (existing is not None and existing.state == "placed" and existing.worker_id in self.handles
                and existing.worker_id != exclude_worker_id):
            return Placement(request_id, existing.worker_id, worker_actor_name(existing.worker_id),
                             existing.num_reserved_blocks)
        if existing is not None and existing.state == "placed":  # re-placed: its old room is free again
            self._reserve(existing.worker_id, -existing.num_reserved_blocks)
        if exclude_worker_id is not None:
            await self.report_failure(exclude_worker_id)
        if request_id not in self.waiting and len(self.waiting) >= self.config.max_pending_placements:
            raise QueueFullError(f"{len(self.waiting)} requests already wait for KV room")
        tokens = reservation_tokens(self.config.policy, num_prompt_tokens, max_tokens, predicted_output_tokens,
                                    num_resumed_tokens)
        num_blocks = blocks_for(tokens, self.config.block_size)
        largest = max((s.num_total_blocks for s in self.latest.values()), default=num_blocks)
        num_blocks = min(num_blocks, largest)  # the worker's own policy copes with the rest
        attempts = existing.num_attempts + 1 if existing is not None else 1
        record = RequestRecord(request_id, None, num_prompt_tokens, max_tokens, predicted_output_tokens or 0,
                               num_blocks, "pending", attempts, time.time())
        pending = PendingRequest(request_id, num_blocks, time.monotonic())
        if not self.waiting:  # fast path: nobody queued ahead, one write if it fits now
            chosen = first_fit_decreasing([pending], self._budgets(), now_s=pending.arrival_s)
            if request_id in chosen:
                return self._commit_placement(record, chosen[request_id], queued_s=0.0)
        self.store.put_request(record)
        waiting = self.waiting.get(request_id)
        if waiting is None:
            waiting = _Waiting(pending, asyncio.get_running_loop().create_future(), record)
            self.waiting[request_id] = waiting
        self._place_waiting()
        try:
            return await asyncio.wait_for(asyncio.shield(waiting.future), self.config.placement_timeout_s)
        except asyncio.TimeoutError:
            self.waiting.pop(request_id, None)
            self.store.delete_request(request_id)
            raise PlacementTimeoutError(
                f"no worker had {num_blocks} free KV blocks within {self.config.placement_timeout_s:.0f} s") from None

    def _place_waiting(self) -> None:
        if not self.waiting:
            return
        budgets = self._budgets()
        pending = [w.request for w in self.waiting.values() if not w.future.done()]
        chosen = first_fit_decreasing(pending, budgets, now_s=time.monotonic())
        for request_id, worker_id in chosen.items():
            waiting = self.waiting.pop(request_id)
            placement = self._commit_placement(waiting.record, worker_id,
                                               time.monotonic() - waiting.request.arrival_s)
            waiting.future.set_result(placement)

    def _commit_placement(self, record: RequestRecord, worker_id: str, queued_s: float) -> Placement:
        self.store.put_request(_with(record, worker_id=worker_id, state="placed"))
        self._reserve(worker_id, record.num_reserved_blocks)
        self._placed_s[record.request_id] = time.monotonic()
        return Placement(record.request_id, worker_id, worker_actor_name(worker_id), record.num_reserved_blocks,
                         queued_s)

    async def finish(self, request_id: str, outcome: RequestOutcome | None = None) -> None:
        """Release a request's reservation; a completed one becomes a training sample."""
        waiting = self.waiting.pop(request_id, None)
        if waiting is not None and not waiting.future.done():
            waiting.future.cancel()
        record = self.store.get_request(request_id)
        if record is not None and record.state == "placed":
            self._reserve(record.worker_id, -record.num_reserved_blocks)
        self.store.delete_request(request_id)
        self.moving.discard(request_id)
        self._placed_s.pop(request_id, None)
        if outcome is not None and outcome.num_output_tokens >= 1 and outcome.finish_reason in ("stop", "length"):
            self.samples.append(TrainingSample(request_id, outcome.prompt_text, outcome.num_prompt_tokens,
                                               outcome.max_tokens, outcome.temperature, outcome.num_output_tokens,
                                               outcome.predicted_output_tokens))
        self.store.incr(f"finished_{outcome.finish_reason if outcome else 'cancelled'}")
        self._place_waiting()

    async def report_failure(self, worker_id: str) -> bool:
        """A router lost a stream from this worker; True when the worker is indeed gone (its requests requeued)."""
        handle = self.handles.get(worker_id)
        if handle is None:
            return True
        try:
            await asyncio.wait_for(handle.stats.remote(), timeout=5.0)
            return False
        except Exception:  # noqa: BLE001 - dead, hung or unreachable all mean replace it
            self._mark_dead(worker_id)
            self._replace_missing_workers()
            return True

    # -- the loop --------------------------------------------------------------

    async def _run(self) -> None:
        self._replace_missing_workers()
        self._ensure_retrainer()
        while True:
            try:
                await self._tick()
            except Exception:  # noqa: BLE001 - the loop must outlive a bad tick (e.g. Redis restarting)
                logger.exception("controller tick failed")
            await asyncio.sleep(self.config.stats_interval_s)

    async def _tick(self) -> None:
        ids = [wid for wid in self.handles if wid not in self._starting]
        results = await asyncio.gather(
            *(asyncio.wait_for(self.handles[wid].stats.remote(), timeout=10.0) for wid in ids), return_exceptions=True)
        for wid, result in zip(ids, results):
            if isinstance(result, BaseException):
                self._mark_dead(wid)
            else:
                self._count_worker_events(self.latest.get(wid), result)
                self.latest[wid] = result
        self._replace_missing_workers()
        await self._move_overruns()
        if time.monotonic() - self._last_reconcile_s >= RECONCILE_INTERVAL_S:
            self._reconcile()
        self._place_waiting()
        self._scale()

    def _reconcile(self) -> None:
        """Drop ledger entries nobody will release: a router that died, or a release call that was lost.

        A placed request its worker does not hold, or a pending one no caller waits for, is
        garbage once older than the grace period (a just-placed request may not have reached
        its worker yet).
        """
        self._last_reconcile_s = now_s = time.monotonic()
        held = {rid for stats in self.latest.values() for rid in stats.request_ids}
        wall_now_s = time.time()
        for record in self.store.requests():
            if record.state == "placed" and record.worker_id in self.latest and record.request_id not in held:
                age_s = now_s - self._placed_s.get(record.request_id, now_s - (wall_now_s - record.created_s))
            elif record.state == "pending" and record.request_id not in self.waiting:
                age_s = wall_now_s - record.created_s
            else:
                continue
            if age_s > RECONCILE_GRACE_S and record.request_id not in self.moving:
                self.store.delete_request(record.request_id)
                self._placed_s.pop(record.request_id, None)
                self.store.incr("reconciled")
        self.reserved = self.store.reserved_blocks_by_worker()

    def _count_worker_events(self, before: WorkerStats | None, now: WorkerStats) -> None:
        """Workers count since they started; the cluster's totals must survive a worker's death."""
        for counter, attr in (("overruns", "num_overruns"), ("preemptions", "num_preemptions")):
            delta = getattr(now, attr) - (getattr(before, attr) if before is not None else 0)
            if delta > 0:
                self.store.incr(counter, delta)

    def _replace_missing_workers(self) -> None:
        while len(self.handles) < max(self.config.num_workers, self.config.min_workers_resolved) \
                and len(self.handles) < self.config.max_workers_resolved:
            self._start_worker()

    async def _move_overruns(self) -> None:
        for wid, stats in list(self.latest.items()):
            for report in stats.overruns:
                if report.request_id in self.moving:
                    continue
                target = migration_target(report.num_blocks_needed, self._budgets(), exclude_worker_id=wid)
                if target is None:
                    continue
                with_kv = report.num_prompt_tokens + report.num_output_tokens >= self.config.migrate_kv_min_tokens
                record = self.store.get_request(report.request_id)
                self.moving.add(report.request_id)
                if record is not None:  # reserve on the target before the router resumes there
                    self.store.put_request(_with(record, worker_id=target, num_reserved_blocks=report.num_blocks_needed))
                    self._reserve(record.worker_id, -record.num_reserved_blocks)
                    self._reserve(target, report.num_blocks_needed)
                moved = await self.handles[wid].move_out.remote(report.request_id, target, with_kv)
                if moved:
                    self.store.incr("migrations")
                    logger.info("moved %s from %s to %s (%s)", report.request_id, wid, target,
                                "with KV" if with_kv else "recompute")
                elif record is not None:
                    self.store.put_request(record)
                    self._reserve(target, -report.num_blocks_needed)
                    self._reserve(record.worker_id, record.num_reserved_blocks)
                    self.moving.discard(report.request_id)

    def _scale(self) -> None:
        ready = self._ready_worker_ids()
        busy = any(self.latest[w].num_running or self.latest[w].num_waiting for w in ready) or self.waiting
        if busy:
            self._idle_since_s = time.monotonic()
        pending_blocks = sum(w.request.num_blocks for w in self.waiting.values())
        free = sum(b.num_free_blocks for b in self._budgets())
        per_worker = max((self.latest[w].num_total_blocks for w in ready), default=1)
        desired = self.scaling.desired_num_workers(len(self.handles), len(self.waiting), pending_blocks, free,
                                                   per_worker, time.monotonic() - self._idle_since_s)
        if desired > len(self.handles):
            for _ in range(desired - len(self.handles)):
                self._start_worker()
        elif desired < len(self.handles):
            idle = [w for w in ready if not self.latest[w].request_ids]
            for wid in idle[: len(self.handles) - desired]:
                logger.info("retiring idle worker %s", wid)
                self._mark_dead(wid)
                self._idle_since_s = time.monotonic()

    # -- reconfiguration -------------------------------------------------------

    async def reconfigure(self, config: dict) -> None:
        """Adopt a rolled-out config (`ServiceConfig.model_dump()`); a no-op when nothing changed.

        The controller is detached and found by name, so a router redeployed with new args
        meets the controller built from the old ones. Running workers keep serving (their
        engine settings stay until they are replaced); the loop starts or retires workers
        toward the new counts, and new workers get the new engine settings.
        """
        new = ServiceConfig(**config)
        if new == self.config:
            return
        logger.info("reconfigured: %d..%d workers (was %d..%d)", new.min_workers_resolved, new.max_workers_resolved,
                    self.config.min_workers_resolved, self.config.max_workers_resolved)
        self.config = new
        self.redis.set(self._config_key(), new.model_dump_json())
        self.scaling = ScalingPolicy(new.min_workers_resolved, new.max_workers_resolved, new.scale_up_queue_depth,
                                     new.scale_down_idle_s)
        self._ensure_started()

    def _config_key(self) -> str:
        """`<prefix>:ctl:config`: the config in force, read back only when Ray restarts this actor."""
        return f"{self.store.prefix}:ctl:config"

    # -- status and shutdown -------------------------------------------------

    async def status(self) -> ClusterStatus:
        self._ensure_started()
        try:
            is_redis_ok = self.health_store.ping()
            workers = tuple(self.health_store.workers())
            reserved = self.health_store.reserved_blocks_by_worker()
            counters = self.health_store.counters()
        except Exception:  # noqa: BLE001 - /health reports Redis as down instead of failing
            is_redis_ok, workers, reserved, counters = False, (), {}, {}
        stats = tuple(self.latest[w] for w in self._ready_worker_ids())
        return ClusterStatus(workers, stats, reserved, len(self.waiting), counters, is_redis_ok)

    async def shutdown(self) -> None:
        """Kill every worker and the retrainer (they are detached, so nothing else would)."""
        for wid in list(self.handles):
            self._mark_dead(wid)
        try:
            ray.kill(ray.get_actor(RETRAINER_NAME, namespace=RAY_NAMESPACE), no_restart=True)
        except ValueError:
            pass  # retraining is off, or it is already gone

    def _ensure_retrainer(self) -> None:
        """The retraining task (named and detached: one per service, surviving controller restarts)."""
        if not self.config.retrain:
            return
        retrain = RetrainConfig(min_new_samples=self.config.retrain_min_samples,
                                max_interval_s=self.config.retrain_interval_s, quantile=self.config.quantile)
        ray.remote(RetrainerActor).options(
            name=RETRAINER_NAME, namespace=RAY_NAMESPACE, lifetime="detached", get_if_exists=True, num_cpus=0.1,
            max_restarts=-1).remote(self.redis_url, self.config.predictor_root, retrain)


def _with(record: RequestRecord, **changes) -> RequestRecord:
    return replace(record, **changes)


def get_or_create_controller(config: ServiceConfig, redis_url: str):
    """The service's controller, created on first use; Ray restarts it (forever) if it dies."""
    return ray.remote(Controller).options(
        name=CONTROLLER_NAME, namespace=RAY_NAMESPACE, lifetime="detached", get_if_exists=True,
        max_restarts=-1, max_task_retries=-1, num_cpus=0, max_concurrency=1000,
    ).remote(config.model_dump(), redis_url)
