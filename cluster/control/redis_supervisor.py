"""A watchdog for the embedded Redis: restarts a redis-server that died, on the same port and data.

Whoever starts the embedded Redis (`s3serve serve`, or the `RedisHost` actor of a cluster
started by `ray job submit`) runs one of these beside it. A thread checks the child every
`check_interval_s`; when it has exited without being asked to (kill -9, OOM killer), the
thread reaps it (no zombie) and starts it again on the same port and data directory, so the
append-only file is replayed and every client reconnects to the address it already has.
Failed starts back off exponentially (`restart_delay_s`). A remote Redis (`S3_REDIS_URL`) is
never supervised: its owner restarts it, our clients only reconnect.

    supervisor = RedisSupervisor(EmbeddedRedis(data_dir)); url = supervisor.start()
    ... supervisor.num_restarts ... supervisor.stop()   # stops the thread, then the server
"""

import logging
import threading
import time

from cluster.control.redis_server import EmbeddedRedis

logger = logging.getLogger(__name__)

FIRST_RESTART_DELAY_S = 0.25
MAX_RESTART_DELAY_S = 8.0


def restart_delay_s(num_failed_starts: int, first_s: float = FIRST_RESTART_DELAY_S,
                    cap_s: float = MAX_RESTART_DELAY_S) -> float:
    """Seconds to wait before the next start after `num_failed_starts` failed ones in a row (0 = restart now)."""
    if num_failed_starts < 0:
        raise ValueError(f"num_failed_starts must be >= 0, got {num_failed_starts}")
    if num_failed_starts == 0:
        return 0.0
    return min(cap_s, first_s * 2 ** (num_failed_starts - 1))


class RedisSupervisor:
    """Keeps one `EmbeddedRedis` running until `stop()`.

    Args:
        server: the embedded Redis to watch (its port is fixed at the first start and kept).
        check_interval_s: how often the thread looks at the child process.
        on_restart: called with the URL after each restart (for logs or counters).
    """

    def __init__(self, server: EmbeddedRedis, check_interval_s: float = 0.2,
                 on_restart=lambda url: None) -> None:
        if check_interval_s <= 0:
            raise ValueError(f"check_interval_s must be > 0, got {check_interval_s}")
        self.server = server
        self.check_interval_s = check_interval_s
        self.on_restart = on_restart
        self.num_restarts = 0
        self.last_error: str | None = None
        self._lock = threading.Lock()  # one start or stop of the server at a time
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def pid(self) -> int | None:
        return self.server.pid

    def start(self) -> str:
        """Start the server (waiting for PING) and the watchdog thread; returns the URL."""
        with self._lock:
            url = self.server.start()
        if self._thread is None or not self._thread.is_alive():
            self._stopping.clear()
            self._thread = threading.Thread(target=self._watch, name="redis-supervisor", daemon=True)
            self._thread.start()
        return url

    def stop(self) -> None:
        """Stop watching, then shut the server down cleanly (its append-only file flushed)."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=30.0)
            self._thread = None
        with self._lock:
            self.server.stop()

    def _watch(self) -> None:
        num_failed = 0
        while not self._stopping.wait(self.check_interval_s if num_failed == 0 else restart_delay_s(num_failed)):
            with self._lock:
                if self._stopping.is_set() or self.server.is_running:  # is_running reaps an exited child
                    num_failed = 0
                    continue
                logger.warning("embedded redis-server exited (status %s); restarting it on %s",
                               self.server.exit_status, self.server.url)
                started_s = time.monotonic()
                try:
                    url = self.server.start()
                except Exception as error:  # noqa: BLE001 - keep trying with backoff; the log tail says why
                    num_failed += 1
                    self.last_error = f"{type(error).__name__}: {error}"
                    logger.error("restarting the embedded redis-server failed (attempt %d, next in %.2f s): %s",
                                 num_failed, restart_delay_s(num_failed), self.last_error)
                    continue
            num_failed = 0
            self.num_restarts += 1
            logger.warning("embedded redis-server is back at %s after %.2f s (restart %d)", url,
                           time.monotonic() - started_s, self.num_restarts)
            self.on_restart(url)
