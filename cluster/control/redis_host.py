"""An embedded Redis owned by a detached Ray actor, for clusters started without a Redis URL.

`s3serve serve` runs the embedded Redis itself; a Serve config rolled out with
`ray job submit` may not name one, so the first builder call starts this actor, which
keeps the redis-server process alive for as long as the Ray cluster lives (a supervisor
thread restarts it if it dies).
"""

from pathlib import Path

import ray

from cluster.config import RAY_NAMESPACE
from cluster.control.redis_server import EmbeddedRedis
from cluster.control.redis_supervisor import RedisSupervisor

REDIS_HOST_NAME = "s3serve-redis"


class RedisHost:
    """Runs one supervised `EmbeddedRedis` in its actor process."""

    def __init__(self, data_dir: str) -> None:
        self.supervisor = RedisSupervisor(EmbeddedRedis(Path(data_dir)))
        self.url = self.supervisor.start()

    def get_url(self) -> str:
        return self.url

    def pid(self) -> int | None:
        return self.supervisor.pid

    def restart(self) -> str:
        self.supervisor.stop()
        return self.supervisor.start()

    def stop(self) -> None:
        self.supervisor.stop()


def ensure_redis(data_dir: str) -> str:
    """The URL of the cluster's embedded Redis, starting it on first use."""
    host = ray.remote(RedisHost).options(name=REDIS_HOST_NAME, namespace=RAY_NAMESPACE, lifetime="detached",
                                         get_if_exists=True, num_cpus=0).remote(str(Path(data_dir) / "redis"))
    return ray.get(host.get_url.remote())
