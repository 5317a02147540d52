"""Starting and stopping the local Ray cluster around the service: Ray's fixed 30 s wait for a node to register gets
a second try on a busy machine, a failed try leaves no process behind, and a start-up that failed before Ray ran
stops without starting a cluster."""

import subprocess
import sys
import time

import psutil
import pytest
import ray

from cluster.config import ServiceConfig
from cluster.local_ray import MAX_RAY_NODE_START_TRIES, SERVE_PROXY_TIMEOUTS_S, start_local_ray
from cluster.service import RunningService, stop_service

NODE_TIMEOUT = Exception("The current node timed out during startup. This could happen because some of the raylet "
                         "failed to startup or the GCS has become overloaded.")
SLEEPER = [sys.executable, "-c", "import subprocess, sys, time; "
           "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); time.sleep(120)"]


class FlakyInit:
    """A stand-in for `ray.init` that starts a process with a child of its own (a raylet and its worker, say), waits
    for both, and raises `errors` in turn, then returns. `trees[i]`: the processes the i-th try started."""

    def __init__(self, errors: list[Exception]):
        self.errors = list(errors)
        self.trees: list[list[psutil.Process]] = []

    def __call__(self, **_options):
        self.trees.append(_started_with_its_child(SLEEPER))
        if self.errors:
            raise self.errors.pop(0)

    def started(self) -> list[psutil.Process]:
        return [process for tree in self.trees for process in tree]


def _started_with_its_child(command: list[str]) -> list[psutil.Process]:
    process = psutil.Process(subprocess.Popen(command).pid)
    deadline_s = time.monotonic() + 30
    while not process.children() and time.monotonic() < deadline_s:
        time.sleep(0.02)
    children = process.children()
    assert len(children) == 1, "the stand-in's child did not start"
    return [process, *children]


def _is_alive(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture
def processes(monkeypatch):
    """Every process a test starts (extended by the test), killed at the end; the environment variables
    start_local_ray sets, put back."""
    for name in SERVE_PROXY_TIMEOUTS_S:
        monkeypatch.delenv(name, raising=False)
    started: list[psutil.Process] = []
    yield started
    for process in started:
        if _is_alive(process):
            process.kill()


def test_a_node_that_misses_rays_registration_window_is_killed_and_started_again(processes):
    older = _started_with_its_child(SLEEPER)  # this process's child from before, with its own: not Ray's
    init, progress = FlakyInit([NODE_TIMEOUT]), []
    processes.extend(older)
    try:
        start_local_ray(3, progress.append, log_to_driver=False, init=init)
        assert len(init.trees) == 2
        assert not any(_is_alive(process) for process in init.trees[0])  # what the failed try started is gone
        assert all(_is_alive(process) for process in init.trees[1] + older)  # the cluster now, and what ran before
        assert len(progress) == 1 and "30 s" in progress[0] and "try 2 of 2" in progress[0]
    finally:
        processes.extend(init.started())


def test_other_start_errors_and_a_last_timeout_are_raised_and_leave_no_process(processes):
    other, always = FlakyInit([RuntimeError("Address already in use")]), FlakyInit([NODE_TIMEOUT] * 5)
    try:
        with pytest.raises(RuntimeError, match="Address already in use"):
            start_local_ray(2, init=other)
        with pytest.raises(Exception, match="timed out during startup"):
            start_local_ray(2, lambda _message: None, init=always)
        assert (len(other.trees), len(always.trees)) == (1, MAX_RAY_NODE_START_TRIES)
        assert not any(_is_alive(process) for process in other.started() + always.started())
    finally:
        processes.extend(other.started() + always.started())


class StoppableRedis:
    def __init__(self):
        self.stopped = False

    def stop(self):
        self.stopped = True


def test_stopping_after_a_start_that_failed_before_ray_ran_starts_no_cluster_and_stops_redis(monkeypatch):
    assert not ray.is_initialized()
    started = []  # Serve's shutdown and ray.get_actor start a local cluster through ray.init when none runs
    monkeypatch.setattr(ray, "init", lambda *args, **options: started.append(options))
    redis = StoppableRedis()
    stop_service(RunningService(ServiceConfig(), "", "", redis, {}))
    assert redis.stopped
    assert started == [] and not ray.is_initialized()
