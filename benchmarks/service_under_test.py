"""The running service as the fault benches (`bench chaos`, `bench soak`) see it: how it is started, its processes,
its health and its memory."""

import os
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import psutil

from benchmarks.small_disk import SmallDisk
from workers.actors.ports import free_port


def _own_pid(actor) -> int:
    return os.getpid()


class ServiceUnderTest:
    """The running service as the faults see it: its processes, its health, its memory.

    Args:
        running: what `cluster.service.start_service` returned.
        config: the bench's config (`recovery_timeout_s`, `stop_s`, ...).
        load_pid: the load generator's process, left out of the service's processes.
        redis_disk: the disk under the embedded Redis, for redis_disk_full.
    """

    def __init__(self, running, config, load_pid: int | None = None,
                 redis_disk: SmallDisk | None = None) -> None:
        self.running = running
        self.config = config
        self.load_pid = load_pid
        self.redis_disk = redis_disk

    def worker_pids(self) -> list[int]:
        import ray

        from cluster.config import CONTROLLER_NAME, RAY_NAMESPACE, worker_actor_name

        status = ray.get(ray.get_actor(CONTROLLER_NAME, namespace=RAY_NAMESPACE).status.remote(), timeout=30)
        busiest = sorted(status.stats, key=lambda s: -(s.num_running + s.num_waiting))
        return [ray.get(ray.get_actor(worker_actor_name(s.worker_id), namespace=RAY_NAMESPACE)
                        .__ray_call__.remote(_own_pid), timeout=30) for s in busiest]

    def controller_pid(self) -> int:
        import ray

        from cluster.config import CONTROLLER_NAME, RAY_NAMESPACE

        controller = ray.get_actor(CONTROLLER_NAME, namespace=RAY_NAMESPACE)
        return ray.get(controller.__ray_call__.remote(_own_pid), timeout=30)

    def redis_pid(self) -> int:
        """The embedded redis-server's process (waiting out a restart after an earlier kill)."""
        redis = self.running.redis
        if redis is None:
            raise ValueError("the Redis faults need the embedded Redis (unset S3_REDIS_URL)")
        deadline_s = time.monotonic() + 30.0
        while redis.pid is None and time.monotonic() < deadline_s:
            time.sleep(0.05)
        return redis.pid

    def wait_until_redis_cannot_write(self, timeout_s: float = 5.0) -> bool:
        """Until the embedded Redis has failed to append to its file (it then refuses writes with MISCONF); False
        when it has not within `timeout_s` (nothing was written meanwhile)."""
        import redis

        client = redis.Redis.from_url(self.running.redis_url, socket_timeout=2.0)
        deadline_s = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline_s:
                try:
                    if client.info("persistence").get("aof_last_write_status") == "err":
                        return True
                except redis.RedisError:
                    pass
                time.sleep(0.05)
            return False
        finally:
            client.close()

    def router_pid(self) -> int:
        """A router replica's process (Ray titles it `ray::ServeReplica:<app>:router`)."""
        for process in self.processes():
            try:
                title = " ".join(process.cmdline())
            except psutil.Error:
                continue  # ended meanwhile
            if "ServeReplica:" in title and ":router" in title:
                return process.pid
        raise RuntimeError("no router replica process found")

    def processes(self) -> list[psutil.Process]:
        """Every process the service runs: this bench's children, less the load generator and its children."""
        skip = set()
        if self.load_pid is not None:
            try:
                load = psutil.Process(self.load_pid)
                skip = {load.pid, *(p.pid for p in load.children(recursive=True))}
            except psutil.NoSuchProcess:
                pass
        return [child for child in psutil.Process().children(recursive=True) if child.pid not in skip]

    def memory_mib(self) -> float:
        """Resident memory of every process the service runs."""
        total = 0
        for process in self.processes():
            try:
                total += process.memory_info().rss
            except psutil.Error:
                pass  # ended meanwhile
        return total / 2**20

    def is_recovered(self) -> bool:
        """/health answers 200 and a two-token chat completes."""
        url = self.running.base_url
        try:
            if httpx.get(f"{url}/health", timeout=5.0).status_code != 200:
                return False
            body = {"model": self.running.config.model_id, "max_tokens": 2, "temperature": 0,
                    "messages": [{"role": "user", "content": "Hi"}]}
            return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30.0).status_code == 200
        except httpx.HTTPError:
            return False

    def recovery_s(self, start_s: float) -> float | None:
        """Seconds from `start_s` (monotonic) until `is_recovered`; None when it never was in the timeout."""
        while time.monotonic() - start_s < self.config.recovery_timeout_s:
            if self.is_recovered():
                return time.monotonic() - start_s
            time.sleep(0.25)
        return None


@contextmanager
def bench_service(config, model_name: str, model_cache_dir: Path | None, work_dir: Path, label: str):
    """The service the fault benches run against (`config`: num_workers, max_concurrent_requests, num_cpus, dtype,
    ready_timeout_s), its data in `work_dir` (the embedded Redis's in `redis_data_dir(work_dir)`); stopped on the
    way out."""
    from cluster.config import ServiceConfig
    from cluster.local_ray import start_local_ray
    from cluster.service import start_service, stop_service

    service_config = ServiceConfig(
        port=free_port(), model=model_name, model_cache_dir=str(model_cache_dir) if model_cache_dir else None,
        data_dir=str(work_dir / "data"), num_workers=config.num_workers, retrain=False,
        max_concurrent_requests=config.max_concurrent_requests, num_torch_threads=1, stats_interval_s=0.5,
        dtype=config.dtype)
    print(f"{label}: starting the service ({config.num_workers} {config.dtype} workers, at most "
          f"{config.max_concurrent_requests} requests at once)", flush=True)
    # Ray started here rather than in start_service only to keep the actors' logs off the bench's output.
    start_local_ray(config.num_cpus, log_to_driver=False)
    running = start_service(service_config, config.ready_timeout_s, progress=lambda _msg: None)
    try:
        yield running
    finally:
        stop_service(running)


def redis_data_dir(work_dir: Path) -> Path:
    """Where `bench_service`'s embedded Redis keeps its files."""
    return work_dir / "data" / "redis"
