"""`python -m deploy.rollout` submitted with the real `ray job submit` to a real two-node local cluster.

The cluster is started with the `ray` CLI (`ray start --head` with the dashboard, whose job
server takes the submission, plus a second `ray start --address` node). Every process of it
inherits a token path unique to the test, which is how teardown finds and checks them: the
test never uses `ray stop`, which would also stop other Ray clusters on this machine.
"""

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import pytest
import yaml

from deploy.rollout import AppBaseline, AppTarget, RolloutError, app_progress
from deploy.rollout import main as rollout_main
from workers.actors.ports import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
MODEL = "smollm2-135m-instruct"
FORCED_TOKENS = 1000


# -- the config is checked before any cluster is touched -------------------------------------


@pytest.mark.parametrize("content, expected", [
    ({"applications": [{"name": "s3serve", "import_path": "cluster.app:build_app", "args": {"num_workers": 0}}]},
     "args: num_workers: Input should be greater than or equal to 1 (got 0)"),
    ({"applications": [{"name": "s3serve", "import_path": "cluster.app:build_app",
                        "args": {"num_workers": 2, "max_workers": 1}}]},
     "need min_workers <= num_workers <= max_workers"),
    ({"applications": [{"name": "s3serve", "import_path": "cluster.app:build_app", "args": {"num_wrokers": 2}}]},
     "num_wrokers: Extra inputs are not permitted"),
    ({"http_options": {"port": 8001},
      "applications": [{"name": "s3serve", "import_path": "cluster.app:build_app", "args": {"port": 8002}}]},
     "args.port 8002 differs from http_options.port 8001"),
    ({"http_options": {"port": "eighty"}, "applications": []}, "http_options.port: Input should be a valid integer"),
    ({"applications": [{"name": "s3serve", "import_path": "other.module:app"}]},
     "no application has import_path cluster.app:build_app"),
    ("applications: [unclosed", "is not valid YAML at line 1, column 24"),
    ("- just\n- a list\n", "must hold a Serve config mapping, got list"),
])
def test_bad_config_is_one_clear_line_and_exit_2(tmp_path, capsys, content, expected):
    config_path = tmp_path / "serve_config.yaml"
    config_path.write_text(content if isinstance(content, str) else yaml.safe_dump(content))
    # No cluster exists at this address: reaching for one would fail differently (exit 1).
    assert rollout_main(["--config", str(config_path), "--address", "127.0.0.1:1"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("rollout: error: invalid config:"), captured.err
    assert expected in lines[0] and lines[1].startswith("hint: ")
    assert captured.out == ""


def test_the_entrypoint_refuses_a_bad_config_before_connecting(tmp_path):
    config_path = tmp_path / "serve_config.yaml"
    config_path.write_text(yaml.safe_dump({"applications": [
        {"name": "s3serve", "import_path": "cluster.app:build_app", "args": {"policy": "fastest"}}]}))
    result = subprocess.run([sys.executable, "-m", "deploy.rollout", "--config", str(config_path)],
                            capture_output=True, text=True, timeout=120, cwd=REPO_ROOT,
                            env={**os.environ, "RAY_ADDRESS": "127.0.0.1:1"})
    assert result.returncode == 2, result.stderr
    assert "policy must be one of max_reserve, paged_greedy, s3, s3_peak, sglang_ratio, got 'fastest'" in result.stderr
    assert "Connecting" not in result.stderr and result.stdout == ""


def test_an_address_nothing_listens_on_fails_fast_with_exit_1(tmp_path, capsys):
    config_path = tmp_path / "serve_config.yaml"
    config_path.write_text(yaml.safe_dump({"applications": [
        {"name": "s3serve", "import_path": "cluster.app:build_app", "args": {}}]}))
    start_s = time.monotonic()
    assert rollout_main(["--config", str(config_path), "--address", f"127.0.0.1:{free_port()}"]) == 1
    waited_s = time.monotonic() - start_s
    assert waited_s < 30, f"failed after {waited_s:.0f} s: a dead address should fail at its first connection"
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and "no Ray cluster answers at 127.0.0.1:" in lines[0] and lines[1].startswith("hint: ")


def test_missing_config_file_exits_2(tmp_path, capsys):
    assert rollout_main(["--config", str(tmp_path / "nope.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err


# -- telling the new version from the old one (pure) ---------------------------------------------

TARGET = AppTarget("s3serve", "http://127.0.0.1:8000/health", {"num_workers": 2}, {}, 2)


def _details(status: str, replicas: dict[str, list[tuple[str, str]]], message: str = "") -> dict:
    deployments = {name: {"target_num_replicas": 1, "replicas": [{"replica_id": rid, "state": state}
                                                                 for rid, state in reps]}
                   for name, reps in replicas.items()}
    return {"applications": {"s3serve": {"status": status, "message": message, "deployments": deployments}}}


def test_old_replicas_still_running_are_not_the_new_version():
    baseline = AppBaseline(frozenset({"r-old", "p-old"}), "RUNNING", "")
    # Serve keeps RUNNING while it builds the new version: the status alone would pass.
    is_new, _ = app_progress(_details("RUNNING", {"router": [("r-old", "RUNNING")],
                                                  "length_predictor": [("p-old", "RUNNING")]}), TARGET, baseline)
    assert not is_new
    is_new, described = app_progress(
        _details("RUNNING", {"router": [("r-old", "STOPPING"), ("r-new", "RUNNING")],
                             "length_predictor": [("p-new", "RUNNING")]}), TARGET, baseline)
    assert is_new, described
    assert "router 1/1 new" in described


def test_unchanged_code_keeps_its_replicas_and_counts_as_rolled_out():
    baseline = AppBaseline(frozenset(), "RUNNING", "")
    is_new, _ = app_progress(_details("RUNNING", {"router": [("r-old", "RUNNING")]}), TARGET, baseline)
    assert is_new


def test_a_new_deploy_failure_stops_the_wait_but_an_old_one_does_not():
    failed = _details("DEPLOY_FAILED", {}, "Traceback ...\nValueError: bad model path")
    with pytest.raises(RolloutError, match="failed to deploy: ValueError: bad model path"):
        app_progress(failed, TARGET, AppBaseline(frozenset(), "RUNNING", ""))
    # The same failure as before the PUT is the old config's: the new one is still building.
    same = AppBaseline(frozenset(), "DEPLOY_FAILED", "Traceback ...\nValueError: bad model path")
    assert app_progress(failed, TARGET, same)[0] is False


# -- the real cluster ------------------------------------------------------------------------------


@dataclass
class LocalCluster:
    """A head and a worker node started with `ray start --block` (SIGTERM stops each node's processes)."""

    temp_dir: Path
    env: dict
    dashboard_url: str
    nodes: list = field(default_factory=list)

    def ray(self, *args: str, timeout_s: float = 900) -> subprocess.CompletedProcess:
        return subprocess.run([str(VENV_BIN / "ray"), *args], env=self.env, cwd=REPO_ROOT, capture_output=True,
                              text=True, timeout=timeout_s)

    def submit(self, *entrypoint: str, timeout_s: float = 900) -> subprocess.CompletedProcess:
        return self.ray("job", "submit", "--address", self.dashboard_url, "--", *entrypoint, timeout_s=timeout_s)

    def own_processes(self) -> list[psutil.Process]:
        """Every live process of this cluster: they all inherited its unique token path."""
        marker = f"RAY_AUTH_TOKEN_PATH={self.env['RAY_AUTH_TOKEN_PATH']}"
        found = []
        for process in psutil.process_iter():
            try:
                if process.pid != os.getpid() and marker in "\n".join(
                        f"{k}={v}" for k, v in process.environ().items()):
                    found.append(process)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        return found


def _start_node(cluster: LocalCluster, args: list[str], log_name: str, ready_line: str) -> None:
    log_path = cluster.temp_dir / log_name
    with open(log_path, "w") as log:
        process = subprocess.Popen([str(VENV_BIN / "ray"), "start", "--block", *args], env=cluster.env,
                                   cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
    cluster.nodes.append(process)
    deadline = time.monotonic() + 120
    while ready_line not in log_path.read_text():
        if process.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"`ray start {' '.join(args)}` did not come up:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.5)


def _stop_cluster(cluster: LocalCluster) -> list[str]:
    """Stop the nodes (worker first), then anything of ours still alive; returns what had to be killed."""
    for process in reversed(cluster.nodes):
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
    deadline = time.monotonic() + 30
    while cluster.own_processes() and time.monotonic() < deadline:
        time.sleep(1)
    leftovers = cluster.own_processes()
    described = [f"{p.pid} {' '.join(p.cmdline())[:120]}" for p in leftovers]
    for process in leftovers:
        process.kill()
    return described


@pytest.fixture
def cluster(tmp_path):
    # Ray's session directory holds unix sockets, whose paths must stay under 108 bytes: pytest's
    # tmp_path is too deep for that, so the cluster lives in a short directory of its own.
    temp_dir = Path(tempfile.mkdtemp(prefix="s3ro", dir="/tmp"))
    token_path = temp_dir / "auth_token"
    token_path.write_text(secrets.token_hex(32))
    gcs_port, dashboard_port = free_port(), free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
           # Token auth (Ray's own default for new clusters), with a token of this test's: the CLI,
           # the job and the nodes read it from here, and it marks every process of this cluster.
           "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_path), "RAY_USAGE_STATS_ENABLED": "0",
           # A node's SIGTERM drains it for up to 30 s first (for Kubernetes upgrades); the test stops the
           # service itself before the teardown, so each node may stop at once (it took 64 s of two drains).
           "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "2"}
    env.pop("RAY_ADDRESS", None)
    dashboard_url = f"http://127.0.0.1:{dashboard_port}"
    running = LocalCluster(temp_dir, env, dashboard_url)
    try:
        # Ray turns 127.0.0.1 into the machine's address for multi-node clusters; the dashboard and
        # Serve's HTTP still bind 127.0.0.1, and the token guards the rest.
        _start_node(running, ["--head", "--node-ip-address", "127.0.0.1", "--port", str(gcs_port), "--num-cpus",
                              "4", "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard_port),
                              "--include-dashboard", "true", "--temp-dir", str(temp_dir / "ray"),
                              "--disable-usage-stats"], "head.log", "Ray runtime started")
        _start_node(running, ["--address", f"127.0.0.1:{gcs_port}", "--num-cpus", "2", "--disable-usage-stats"],
                    "worker.log", "Ray runtime started")
        yield running
    finally:
        leftovers = _stop_cluster(running)
        shutil.rmtree(temp_dir, ignore_errors=True)
        assert not leftovers, f"processes outlived `ray start --block`'s shutdown: {leftovers}"


def _write_config(path: Path, http_port: int, data_dir: Path, model_cache_dir: Path, num_workers: int) -> Path:
    config = {
        # Both nodes share this machine: one proxy, or the second could not bind the port.
        "proxy_location": "HeadOnly",
        "http_options": {"host": "127.0.0.1", "port": http_port},
        "applications": [{
            "name": "s3serve", "route_prefix": "/", "import_path": "cluster.app:build_app",
            "args": {"model_cache_dir": str(model_cache_dir), "num_workers": num_workers, "max_model_len": 1536,
                     "kv_cache_memory": 64 * 1024**2, "default_max_tokens": 32, "data_dir": str(data_dir),
                     "num_torch_threads": 1, "stats_interval_s": 0.25, "worker_num_cpus": 0.5},
        }],
    }
    path.write_text(yaml.safe_dump(config))
    return path


def _stream_completion(base_url: str, outcome: dict) -> None:
    """A long forced-length streaming completion; records its tokens, finish reason and end time."""
    body = {"model": MODEL, "prompt": "Tell me a long story about a lighthouse keeper.", "max_tokens": FORCED_TOKENS,
            "ignore_eos": True, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    text, reasons = [], []
    try:
        with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=600) as response:
            outcome["status"] = response.status_code
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line.removeprefix("data: "))
                if "error" in event:
                    outcome["error"] = event["error"]
                for choice in event.get("choices", ()):
                    text.append(choice.get("text") or "")
                    reasons.append(choice.get("finish_reason"))
                if event.get("usage"):
                    outcome["usage"] = event["usage"]
                outcome.setdefault("first_token_s", time.monotonic())
    except httpx.HTTPError as error:
        outcome["error"] = repr(error)
    outcome.update(text="".join(text), finish_reason=next((r for r in reversed(reasons) if r), None),
                   end_s=time.monotonic())


def _workers_ready_over(base_url: str, watch_s: float) -> set[int]:
    """Once /health answers 200 again, the worker counts it reports during `watch_s` seconds."""
    deadline = time.monotonic() + 120
    while httpx.get(f"{base_url}/health", timeout=30).status_code != 200:
        assert time.monotonic() < deadline, "the service did not become healthy again"
        time.sleep(0.5)
    seen, end_s = set(), time.monotonic() + watch_s
    while time.monotonic() < end_s:
        response = httpx.get(f"{base_url}/health", timeout=30)
        seen.add(response.json().get("workers_ready") if response.status_code == 200 else None)
        time.sleep(0.25)
    return seen


def _router_replicas(cluster: LocalCluster) -> list[dict]:
    """The router's replicas (id, state) from the dashboard's Serve REST API."""
    token = Path(cluster.env["RAY_AUTH_TOKEN_PATH"]).read_text().strip()
    response = httpx.get(f"{cluster.dashboard_url}/api/serve/applications/", timeout=30,
                         headers={"Authorization": f"Bearer {token}"})
    response.raise_for_status()
    app = response.json()["applications"].get("s3serve") or {}
    return app.get("deployments", {}).get("router", {}).get("replicas", [])


def _stop_embedded_redis_and_workers(cluster: LocalCluster) -> subprocess.CompletedProcess:
    script = ("import ray; ray.init(address='auto'); "
              "c = ray.get_actor('s3serve-controller', namespace='s3serve'); ray.get(c.shutdown.remote()); "
              "r = ray.get_actor('s3serve-redis', namespace='s3serve'); ray.get(r.stop.remote()); print('stopped')")
    return cluster.submit("python", "-c", script, timeout_s=120)


@pytest.mark.slow
def test_ray_job_submit_rollout_then_a_changed_config_keeps_in_flight_streams(cluster, tmp_path, model_cache_dir):
    http_port = free_port()
    base_url = f"http://127.0.0.1:{http_port}"
    data_dir = tmp_path / "data"
    one = _write_config(tmp_path / "one_worker.yaml", http_port, data_dir, model_cache_dir, num_workers=1)
    two = _write_config(tmp_path / "two_workers.yaml", http_port, data_dir, model_cache_dir, num_workers=2)
    try:
        first = cluster.submit("python", "-m", "deploy.rollout", "--config", str(one), "--timeout-s", "600")
        assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-2000:]
        assert f"S3 Serve is ready at {base_url}" in first.stdout
        assert "rollout: healthy after" in first.stdout
        assert httpx.get(f"{base_url}/health", timeout=30).json()["workers_ready"] == 1

        completion = httpx.post(f"{base_url}/v1/completions", timeout=300, json={
            "model": MODEL, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0})
        assert completion.status_code == 200, completion.text
        assert completion.json()["choices"][0]["text"]

        outcome: dict = {}
        streaming = threading.Thread(target=_stream_completion, args=(base_url, outcome), daemon=True)
        streaming.start()
        deadline = time.monotonic() + 120
        while "first_token_s" not in outcome and streaming.is_alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "first_token_s" in outcome, outcome

        old_routers = {r["replica_id"] for r in _router_replicas(cluster)}
        rolled: dict = {}
        rolling = threading.Thread(target=lambda: rolled.update(result=cluster.submit(
            "python", "-m", "deploy.rollout", "--config", str(two), "--timeout-s", "600")), daemon=True)
        rolling.start()
        # Evidence of the drain: the old router stopping while a new one serves, and the stream,
        # which only the old router can hold, still running at that moment.
        is_drained_while_streaming = False
        while rolling.is_alive():
            routers = _router_replicas(cluster)
            is_replaced = any(r["state"] == "STOPPING" and r["replica_id"] in old_routers for r in routers) and any(
                r["state"] == "RUNNING" and r["replica_id"] not in old_routers for r in routers)
            is_drained_while_streaming |= is_replaced and streaming.is_alive()
            time.sleep(1.0)
        second = rolled["result"]
        assert second.returncode == 0, second.stdout[-4000:] + second.stderr[-2000:]
        assert "rollout: healthy after" in second.stdout
        health = httpx.get(f"{base_url}/health", timeout=30).json()
        assert health["status"] == "ok" and health["workers_ready"] == 2, health
        assert is_drained_while_streaming, f"the stream did not outlive the old router's replacement: {outcome}"

        streaming.join(timeout=600)
        assert not streaming.is_alive(), "the stream never finished"
        assert outcome.get("status") == 200 and "error" not in outcome, outcome
        assert outcome["usage"]["completion_tokens"] == FORCED_TOKENS and outcome["finish_reason"] == "length"

        after = httpx.post(f"{base_url}/v1/completions", timeout=300, json={
            "model": MODEL, "prompt": "Two plus two is", "max_tokens": 4, "temperature": 0})
        assert after.status_code == 200, after.text

        # Ray restarts a killed controller with its creation args (one worker at most); it must keep
        # the rolled-out config instead of retiring the second worker.
        killed = cluster.submit("python", "-c", "import ray; ray.init(address='auto'); ray.kill(ray.get_actor("
                                "'s3serve-controller', namespace='s3serve'), no_restart=False); print('killed')")
        assert killed.returncode == 0 and "killed" in killed.stdout, killed.stdout[-2000:] + killed.stderr
        assert _workers_ready_over(base_url, watch_s=5.0) == {2}
    finally:
        # Workers and the embedded redis-server are detached: stopped here, checked gone by the fixture.
        stopped = _stop_embedded_redis_and_workers(cluster)
    assert stopped.returncode == 0 and "stopped" in stopped.stdout, stopped.stdout[-2000:] + stopped.stderr
