"""The embedded real redis-server: start, persistence across restarts, and clients that survive them."""

import socket
import threading
import time
from pathlib import Path

import pytest
import redis

from cluster.control.redis_server import EmbeddedRedis, connect, redis_server_executable


def test_start_answers_on_localhost_with_persistence_on(server):
    assert server.is_running
    assert server.url == f"redis://127.0.0.1:{server.port}"
    client = connect(server.url)
    assert client.ping()
    config = client.config_get("*")
    assert config["appendonly"] == "yes"
    assert config["appendfsync"] in ("everysec", "always")
    assert config["bind"] == "127.0.0.1"
    assert Path(config["dir"]) == server.data_dir.resolve()


def test_client_returns_text(server):
    client = connect(server.url)
    client.set("greeting", "héllo")
    assert client.get("greeting") == "héllo"


def test_state_survives_restart_on_same_port_and_client_keeps_working(server):
    client = connect(server.url)
    client.hset("survivor", mapping={"a": "1", "b": "2"})
    port = server.port
    url = server.restart()
    assert server.port == port and url == server.url
    # The same client object, whose pooled connection the old server closed, reconnects by itself.
    assert client.hgetall("survivor") == {"a": "1", "b": "2"}
    client.incr("after_restart")
    assert client.get("after_restart") == "1"


def test_client_rides_out_a_short_outage(server):
    client = connect(server.url, max_retry_s=5.0)
    client.set("k", "v")
    server.stop()
    assert not server.is_running
    restarter = _start_later(server, delay_s=0.5)
    try:
        assert client.get("k") == "v"  # issued while Redis is down; retried until it is back
    finally:
        restarter.join()
    assert server.is_running


def test_unreachable_server_fails_after_the_retry_budget():
    client = connect(f"redis://127.0.0.1:{_closed_port()}", max_retry_s=0.3)
    started_s = time.monotonic()
    with pytest.raises(redis.ConnectionError):
        client.ping()
    waited_s = time.monotonic() - started_s
    assert waited_s < 3.0, f"gave up {waited_s:.1f} s after a 0.3 s retry budget: the budget is not honoured"


def test_bad_urls_give_clear_errors():
    with pytest.raises(ValueError, match="must start with redis://, rediss:// or unix://, got 'http://x:1'"):
        connect("http://x:1")
    with pytest.raises(ValueError, match="no host"):
        connect("redis://")
    with pytest.raises(ValueError, match="bad port"):
        connect("redis://localhost:notaport")
    # Passwords never appear in error messages.
    with pytest.raises(ValueError) as error:
        connect("http://user:secret@x:1")
    assert "secret" not in str(error.value) and "***" in str(error.value)


def test_password_and_tls_are_taken_from_the_url():
    client = connect("rediss://alice:s3cret@redis.example:6380/2")
    kwargs = client.connection_pool.connection_kwargs
    assert (kwargs["username"], kwargs["password"], kwargs["host"], kwargs["port"], kwargs["db"]) == (
        "alice", "s3cret", "redis.example", 6380, 2)
    assert client.connection_pool.connection_class is redis.SSLConnection


def test_password_protected_server_accepts_the_password_from_the_url(server):
    admin = connect(server.url)
    admin.acl_setuser("svc", enabled=True, passwords=["+pw1"], keys=["*"], commands=["+@all"])
    try:
        authed = connect(f"redis://svc:pw1@127.0.0.1:{server.port}")
        assert authed.acl_whoami() == "svc"
        with pytest.raises(redis.AuthenticationError):
            # redis-py counts a failed AUTH as a connection error, so it is retried: keep the budget short.
            connect(f"redis://svc:wrong@127.0.0.1:{server.port}", max_retry_s=0.2).ping()
    finally:
        admin.acl_deluser("svc")


def test_a_server_started_with_requirepass_keeps_the_password_off_its_command_line(tmp_path):
    with EmbeddedRedis(tmp_path, password="pw-42") as server:
        assert server.url == f"redis://:pw-42@127.0.0.1:{server.port}"
        assert connect(server.url).ping()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=server.port).ping()
        assert b"pw-42" not in Path(f"/proc/{server.pid}/cmdline").read_bytes()
        url = server.restart()  # the supervisor's restart keeps the password
        assert connect(url).ping()
    assert not server.is_running  # SHUTDOWN authenticated too
    with pytest.raises(ValueError, match="password must be non-empty"):
        EmbeddedRedis(tmp_path, password="a b")


def test_start_up_stops_at_a_redis_that_refuses_the_password_or_does_not_answer(tmp_path):
    from cluster.service import check_redis
    from cluster.start_error import ServiceStartError

    with EmbeddedRedis(tmp_path, password="right") as server:
        check_redis(server.url)
        with pytest.raises(ServiceStartError, match=r"Redis at redis://:\*\*\*@127\.0\.0\.1:\d+ refused") as raised:
            check_redis(f"redis://:wrong@127.0.0.1:{server.port}", max_retry_s=0.2)
        assert "wrong" not in str(raised.value)
    with pytest.raises(ServiceStartError, match="does not answer: ConnectionError"):
        check_redis(f"redis://127.0.0.1:{_closed_port()}", max_retry_s=0.2)


def test_start_failure_reports_the_log_tail(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        embedded = EmbeddedRedis(tmp_path, port=port)
        with pytest.raises(RuntimeError, match=r"(?s)exited .*log tail:.*"):
            embedded.start()
    assert not embedded.is_running


def test_bad_arguments_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="port must be in"):
        EmbeddedRedis(tmp_path, port=70000)
    with pytest.raises(ValueError, match="appendfsync must be"):
        EmbeddedRedis(tmp_path, appendfsync="no")
    with pytest.raises(RuntimeError, match="start"):
        _ = EmbeddedRedis(tmp_path).url


def test_fresh_server_on_the_same_data_dir_finds_the_data(tmp_path):
    with EmbeddedRedis(tmp_path / "data") as first:
        connect(first.url).set("durable", "yes")
    assert not first.is_running
    with EmbeddedRedis(tmp_path / "data") as second:  # another port, same files
        assert connect(second.url).get("durable") == "yes"
    assert redis_server_executable().is_file()


def _start_later(server: EmbeddedRedis, delay_s: float):
    def run() -> None:
        time.sleep(delay_s)
        server.start()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
