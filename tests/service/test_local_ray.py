"""Starting and stopping the local Ray cluster around the service: Ray's fixed 30 s wait for a node's raylet gets
a second try on a busy machine, and a start-up that failed before Ray ran stops without starting a cluster."""

import subprocess
import sys

import psutil
import pytest
import ray

from cluster.config import RAY_NAMESPACE, ServiceConfig
from cluster.service import (RAY_NODE_START_TRIES, SERVE_PROXY_TIMEOUTS_S, RunningService, start_local_ray,
                             stop_service)

NODE_TIMEOUT = Exception("The current node timed out during startup. This could happen because some of the raylet "
                         "failed to startup or the GCS has become overloaded.")


class FlakyInit:
    """A stand-in for `ray.init` that starts a process (a raylet, say) and raises `errors` in turn, then returns."""

    def __init__(self, errors: list[Exception]):
        self.errors = list(errors)
        self.calls: list[dict] = []
        self.started: list[psutil.Process] = []

    def __call__(self, **options):
        self.calls.append(options)
        process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        self.started.append(psutil.Process(process.pid))
        if self.errors:
            raise self.errors.pop(0)


@pytest.fixture(autouse=True)
def _own_environment(monkeypatch):
    for name in SERVE_PROXY_TIMEOUTS_S:  # start_local_ray sets them; put them back afterwards
        monkeypatch.delenv(name, raising=False)
    yield


def _is_alive(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_node_that_misses_rays_registration_window_is_killed_and_started_again():
    init, progress = FlakyInit([NODE_TIMEOUT]), []
    try:
        start_local_ray(3, progress.append, log_to_driver=False, init=init)
        assert len(init.calls) == 2
        assert init.calls[1] == {"num_cpus": 3, "namespace": RAY_NAMESPACE, "include_dashboard": False,
                                 "logging_level": "WARNING", "log_to_driver": False}
        assert not _is_alive(init.started[0])  # what the failed try started is gone
        assert _is_alive(init.started[1])  # what the second one started is left running
        assert len(progress) == 1 and "30 s" in progress[0] and "try 2 of 2" in progress[0]
    finally:
        for process in init.started:
            if _is_alive(process):
                process.kill()


def test_other_start_errors_and_a_last_timeout_are_raised_as_they_are():
    other = FlakyInit([RuntimeError("Address already in use")])
    with pytest.raises(RuntimeError, match="Address already in use"):
        start_local_ray(2, init=other)
    always = FlakyInit([NODE_TIMEOUT] * RAY_NODE_START_TRIES)
    with pytest.raises(Exception, match="timed out during startup"):
        start_local_ray(2, lambda _message: None, init=always)
    assert (len(other.calls), len(always.calls)) == (1, RAY_NODE_START_TRIES)
    for process in other.started + always.started:
        if _is_alive(process):
            process.kill()


class StoppedRedis:
    def __init__(self):
        self.stopped = False

    def stop(self):
        self.stopped = True


def test_stopping_after_a_start_that_failed_before_ray_ran_starts_no_cluster_and_stops_redis(monkeypatch):
    assert not ray.is_initialized()
    started = []
    monkeypatch.setattr(ray, "init", lambda *args, **options: started.append(options))  # Serve's shutdown calls it
    redis = StoppedRedis()
    stop_service(RunningService(ServiceConfig(), "", "", redis, {}))
    assert redis.stopped
    assert started == [] and not ray.is_initialized()
