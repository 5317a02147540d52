"""The embedded Redis's watchdog: a killed redis-server comes back on the same port with its data."""

import os
import signal
import socket
import time

import psutil
import pytest

from cluster.control.redis_server import EmbeddedRedis, connect
from cluster.control.redis_supervisor import RedisSupervisor, restart_delay_s


def test_restart_delay_backs_off_to_a_cap():
    assert restart_delay_s(0) == 0.0
    delays = [restart_delay_s(n, first_s=0.25, cap_s=2.0) for n in range(1, 7)]
    assert delays == [0.25, 0.5, 1.0, 2.0, 2.0, 2.0]
    with pytest.raises(ValueError, match="num_failed_starts"):
        restart_delay_s(-1)


def _wait_for(predicate, timeout_s: float) -> float:
    start_s = time.monotonic()
    while not predicate():
        if time.monotonic() - start_s > timeout_s:
            pytest.fail(f"not true within {timeout_s} s")
        time.sleep(0.02)
    return time.monotonic() - start_s


def test_a_killed_server_is_reaped_and_restarted_on_the_same_port_with_its_data(tmp_path):
    restarted = []
    supervisor = RedisSupervisor(EmbeddedRedis(tmp_path, appendfsync="always"), check_interval_s=0.05,
                                 on_restart=restarted.append)
    url = supervisor.start()
    try:
        client = connect(url, max_retry_s=10.0)
        client.set("kept", "yes")
        first_pid = supervisor.pid
        os.kill(first_pid, signal.SIGKILL)
        _wait_for(lambda: supervisor.num_restarts == 1, timeout_s=10.0)
        assert supervisor.url == url and restarted == [url]
        assert supervisor.pid not in (None, first_pid)
        assert not psutil.pid_exists(first_pid) or psutil.Process(first_pid).status() != psutil.STATUS_ZOMBIE
        assert client.get("kept") == "yes"  # the same client reconnects; the append-only file was replayed
        os.kill(supervisor.pid, signal.SIGKILL)  # and again
        _wait_for(lambda: supervisor.num_restarts == 2, timeout_s=10.0)
        assert client.get("kept") == "yes"
        client.close()
    finally:
        supervisor.stop()
    assert supervisor.pid is None


def test_a_stopped_supervisor_restarts_nothing(tmp_path):
    supervisor = RedisSupervisor(EmbeddedRedis(tmp_path), check_interval_s=0.05)
    supervisor.start()
    supervisor.stop()
    time.sleep(0.3)
    assert supervisor.pid is None and supervisor.num_restarts == 0
    supervisor.start()  # and it can be started again
    try:
        assert connect(supervisor.url).ping()
    finally:
        supervisor.stop()


def test_a_server_that_cannot_start_is_retried_with_backoff(tmp_path):
    # The first check comes a second after start: the test takes the port well before it.
    supervisor = RedisSupervisor(EmbeddedRedis(tmp_path), check_interval_s=1.0)
    supervisor.start()
    squatter = socket.socket()
    try:
        os.kill(supervisor.pid, signal.SIGKILL)
        time.sleep(0.1)
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", supervisor.server.port))
        squatter.listen()
        _wait_for(lambda: supervisor.last_error is not None, timeout_s=15.0)
        assert "Address already in use" in supervisor.last_error and supervisor.num_restarts == 0
        squatter.close()
        _wait_for(lambda: supervisor.num_restarts == 1, timeout_s=20.0)
        assert connect(supervisor.url).ping()
    finally:
        squatter.close()
        supervisor.stop()
