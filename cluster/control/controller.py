"""The controller actor: one named, detached Ray actor around a `ControlPlane` (restarted by Ray if it dies).

It builds the control plane's parts (an asyncio Redis client, the store, Ray worker
actors as the pool's backend), starts it on the first call, runs its loop, keeps the
config it serves in Redis across restarts, and starts the retraining task. Every
decision lives in `cluster.control.control_plane` and the pure modules it calls.
"""

import asyncio
import gc
import logging
import os

import ray

from cluster.config import CONTROLLER_NAME, RAY_NAMESPACE, RETRAINER_NAME, ServiceConfig, worker_actor_name
from cluster.control.control_plane import ControlPlane
from cluster.control.messages import ClusterStatus, Placement, RequestOutcome
from cluster.control.redis_server import connect_async
from cluster.control.store import ControllerStore
from cluster.control.worker_pool import RayWorkerBackend
from workers.actors.worker_settings import WorkerSettings
from workers.scheduling.policies import length_range_tokens

logger = logging.getLogger(__name__)

REDIS_RETRY_S = 2.0


def worker_settings(config: ServiceConfig) -> WorkerSettings:
    """What a new worker is built with, from the config in force."""
    # Every rank of a tensor-parallel worker runs its own torch threads.
    ranks = config.max_workers_resolved * config.tensor_parallel_size
    threads = config.num_torch_threads or max(1, (os.cpu_count() or 1) // ranks)
    return config.worker_settings(num_torch_threads=threads)


class Controller:
    """The service's controller (see the module docstring).

    Args:
        config: `ServiceConfig.model_dump()`.
        redis_url: the service's Redis.
    """

    def __init__(self, config: dict, redis_url: str) -> None:
        config = ServiceConfig(**config).without_secrets()  # it stores its config in Redis
        self.redis_url = redis_url
        # A placement waits at most ~2 s for Redis (the supervisor restarts a dead one in well under that),
        # then the router answers 503 with Retry-After; releases are queued meanwhile (`Ledger.remove`).
        self.store = ControllerStore(connect_async(redis_url, max_retry_s=REDIS_RETRY_S))
        # /health must answer fast while Redis is down; the main client retries for seconds.
        health_store = ControllerStore(connect_async(redis_url, max_retry_s=0.5, socket_timeout_s=1.0))
        backend = RayWorkerBackend(lambda: worker_settings(self.plane.config), config.worker_num_cpus,
                                   config.worker_num_gpus, RAY_NAMESPACE, worker_actor_name)
        self.plane = ControlPlane(config, self.store, backend, health_store)
        # Ray restarts an actor with its creation args; the config rolled out since then is in Redis.
        self._reconstructed = ray.get_runtime_context().was_current_actor_reconstructed
        self._start_task: asyncio.Task | None = None
        self._loop_task: asyncio.Task | None = None

    async def _started(self) -> ControlPlane:
        """Start the control plane once (again, if an earlier start failed, e.g. Redis was restarting)."""
        if self._start_task is None or (self._start_task.done() and self._start_task.exception() is not None):
            self._start_task = asyncio.get_running_loop().create_task(self._start())
        await asyncio.shield(self._start_task)
        return self.plane

    async def _start(self) -> None:
        if self._reconstructed:
            stored = await self.store.get_config()
            if stored:
                self.plane.adopt(ServiceConfig.model_validate_json(stored).without_secrets())
        else:
            await self.store.set_config(self.plane.config.model_dump_json())
        await self.plane.start()
        # The controller's state is long-lived: keep the cyclic GC from re-scanning it (pauses of tens of ms
        # on a large ledger showed in placement latency).
        gc.freeze()
        self._loop_task = asyncio.get_running_loop().create_task(self.plane.run())
        self._ensure_retrainer()

    # -- what routers call -------------------------------------------------------------

    async def place(self, request_id: str, num_prompt_tokens: int, max_tokens: int,
                    predicted_output_tokens: int | None, num_resumed_tokens: int = 0,
                    exclude_worker_id: str | None = None, priority: int = 0,
                    prefix_hashes: tuple[int, ...] = (), sibling_of: str | None = None) -> Placement:
        plane = await self._started()
        return await plane.place(request_id, num_prompt_tokens, max_tokens, predicted_output_tokens,
                                 num_resumed_tokens, exclude_worker_id, priority, prefix_hashes, sibling_of)

    async def finish(self, request_id: str, outcome: RequestOutcome | None = None) -> None:
        await (await self._started()).finish(request_id, outcome)

    async def report_failure(self, worker_id: str) -> bool:
        return await (await self._started()).report_failure(worker_id)

    async def status(self) -> ClusterStatus:
        return await (await self._started()).status()

    async def reconfigure(self, config: dict) -> None:
        """Adopt a rolled-out config (`ServiceConfig.model_dump()`); a no-op when nothing changed.

        The controller is detached and found by name, so a router redeployed with new args
        meets the controller built from the old ones. Running workers keep serving (their
        engine settings stay until they are replaced); the loop starts or retires workers
        toward the new counts, and new workers get the new engine settings.
        """
        plane = await self._started()
        new = ServiceConfig(**config).without_secrets()
        if new == plane.config:
            return
        logger.info("reconfigured: %d..%d workers (was %d..%d)", new.min_workers_resolved, new.max_workers_resolved,
                    plane.config.min_workers_resolved, plane.config.max_workers_resolved)
        plane.adopt(new)
        await self.store.set_config(new.model_dump_json())

    async def shutdown(self) -> None:
        """Kill every worker and the retrainer (they are detached, so nothing else would)."""
        plane = await self._started()
        if self._loop_task is not None:
            self._loop_task.cancel()
        await plane.shutdown()
        try:
            ray.kill(ray.get_actor(RETRAINER_NAME, namespace=RAY_NAMESPACE), no_restart=True)
        except ValueError:
            pass  # retraining is off, or it is already gone

    def _ensure_retrainer(self) -> None:
        """The retraining task (named and detached: one per service, surviving controller restarts)."""
        from predictor_service.retraining import RetrainConfig
        from predictor_service.retraining_actor import RetrainerActor

        config = self.plane.config
        if not config.retrain:
            return
        retrain = RetrainConfig(min_new_samples=config.retrain_min_samples,
                                max_interval_s=config.retrain_interval_s, quantile=config.quantile,
                                max_len=length_range_tokens(config.max_model_len), model=config.model)
        ray.remote(RetrainerActor).options(
            name=RETRAINER_NAME, namespace=RAY_NAMESPACE, lifetime="detached", get_if_exists=True, num_cpus=0.1,
            max_restarts=-1).remote(self.redis_url, config.predictor_root, retrain)


def get_or_create_controller(config: ServiceConfig, redis_url: str):
    """The service's controller, created on first use; Ray restarts it (forever) if it dies."""
    return ray.remote(Controller).options(
        name=CONTROLLER_NAME, namespace=RAY_NAMESPACE, lifetime="detached", get_if_exists=True,
        max_restarts=-1, max_task_retries=-1, num_cpus=0, max_concurrency=1000,
    ).remote(config.model_dump(), redis_url)
