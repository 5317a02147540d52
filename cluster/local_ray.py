"""The local Ray cluster that `s3serve serve` and the service benches start: Serve's proxy checks widened for a busy
machine, and a second try when the node misses Ray's fixed registration window.

    allow_slow_serve_proxy -> ray.init -> (node timed out: kill what the try started -> ray.init once more)
"""

import os

from cluster.config import RAY_NAMESPACE

# Serve checks that its HTTP proxy is up with a 5 s timeout, three times, and kills and restarts a proxy that
# misses it; with every core of a 2-core machine busy with another process the proxy takes about two minutes to
# start, so it never came up. Our local cluster gets generous timeouts (a cluster started by `ray start` keeps
# its own settings).
SERVE_PROXY_TIMEOUTS_S = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": 600.0,
                          "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": 60.0}

# Ray waits a fixed 30 s (`raylet_start_wait_time_s` in ray/_private/node.py) for a new node to register with its
# GCS; on a 2-core machine whose cores are busy that ran out once in CI. A second try gets another 30 s.
MAX_RAY_NODE_START_TRIES = 2
RAY_NODE_TIMEOUT_TEXT = "timed out during startup"

# What a failed try started is killed and waited for at most this long before the next try or the error.
KILL_WAIT_S = 10.0


def allow_slow_serve_proxy() -> None:
    """Give Serve's proxy checks `SERVE_PROXY_TIMEOUTS_S` (unless set); call before `ray.init` of a local cluster,
    whose processes inherit the environment."""
    for name, value_s in SERVE_PROXY_TIMEOUTS_S.items():
        os.environ.setdefault(name, str(value_s))


def start_local_ray(num_cpus: int | None, progress=print, log_to_driver: bool = True, init=None) -> None:
    """A local Ray cluster in our namespace (`num_cpus` None: Ray counts the cores; `init`: a stand-in for `ray.init`
    in tests), with Serve's slow-proxy allowance. A try that fails leaves no process behind: Ray never records a
    node whose start raised, so `ray.shutdown` would not stop its GCS and raylet; the processes this one started
    during the try are killed instead. A node that missed Ray's registration window is then tried once more."""
    import psutil
    import ray

    allow_slow_serve_proxy()
    init = init or ray.init
    for attempt in range(1, MAX_RAY_NODE_START_TRIES + 1):
        children_before = {child.pid for child in psutil.Process().children()}
        try:
            init(num_cpus=num_cpus, namespace=RAY_NAMESPACE, include_dashboard=False, logging_level="WARNING",
                 log_to_driver=log_to_driver)
            return
        except Exception as error:
            ray.shutdown()
            kill_new_children(children_before)
            if RAY_NODE_TIMEOUT_TEXT not in str(error) or attempt == MAX_RAY_NODE_START_TRIES:
                raise
            progress(f"  ... Ray's node did not register within Ray's fixed 30 s (a busy machine); starting it "
                     f"again (try {attempt + 1} of {MAX_RAY_NODE_START_TRIES})")


def kill_new_children(children_before: set[int]) -> None:
    """Kill this process's children that are not in `children_before`, with their own descendants (a raylet's
    workers), and wait for them; children from before, and whatever they started since, are left alone."""
    import psutil

    new = [child for child in psutil.Process().children() if child.pid not in children_before]
    doomed = []
    for child in new:
        try:
            doomed += child.children(recursive=True) + [child]
        except psutil.NoSuchProcess:
            pass
    for process in doomed:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(doomed, timeout=KILL_WAIT_S)
