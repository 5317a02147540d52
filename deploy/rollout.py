"""`python -m deploy.rollout`: deploy or update the Serve app on the Ray cluster this job runs in.

    ray job submit --address http://HEAD:8265 -- python -m deploy.rollout --config deploy/serve_config.yaml

    read the Serve config file -> validate it (Ray's schema, then each s3serve app's args as ServiceConfig)
    -> ray.init(address) -> PUT it to the dashboard's Serve REST API (what `serve deploy` and KubeRay do)
    -> poll until every s3serve app runs the new version and its /health answers 200 with its workers
    -> print the URL, exit 0.   Invalid config: exit 2 before touching a cluster.   Not healthy: exit 1.

The REST API is Serve's declarative path, so a file rolled out here behaves exactly as the same
file in a RayService: the builder runs on the cluster and `http_options` apply when Serve starts.
Changed `args` are a new code version: Serve starts a new router replica and lets the old one
drain its in-flight requests (the router's graceful_shutdown_timeout_s), and the new router hands
the running controller its config (`Controller.reconfigure`), which grows or shrinks the pool.
"""

import argparse
import json
import socket
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import ValidationError

from cluster.config import ServiceConfig

BUILDER_IMPORT_PATH = "cluster.app:build_app"
PROGRESS_EVERY_S = 5.0
POLL_S = 1.0


class RolloutError(Exception):
    """A rollout that cannot go on; `hint` says what to do about it."""

    def __init__(self, message: str, hint: str) -> None:
        super().__init__(message)
        self.hint = hint


@dataclass(frozen=True, slots=True)
class AppTarget:
    """One s3serve application of the config file and what "healthy" means for it."""

    name: str
    health_url: str
    args: dict
    runtime_env: dict
    num_min_workers: int


@dataclass(frozen=True, slots=True)
class RolloutPlan:
    """A validated config file: what to PUT, where HTTP listens, which apps to wait for."""

    deploy_config: dict
    http_host: str
    http_port: int
    apps: tuple[AppTarget, ...]


def load_plan(path: Path | str) -> RolloutPlan:
    """Read and validate a Serve config file; ValueError (showing the offending values) if it is wrong."""
    from ray.serve.schema import ServeDeploySchema

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"config file {path} does not exist")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ValueError(f"config file {path} is not valid YAML{where}: {getattr(error, 'problem', None) or error}"
                         ) from None
    if not isinstance(raw, dict):
        raise ValueError(f"config file {path} must hold a Serve config mapping, got {type(raw).__name__}")
    try:
        schema = ServeDeploySchema.model_validate(raw)
    except ValidationError as error:
        raise ValueError(f"config file {path}: {_first_error(error)}") from None
    builder_apps = [app for app in schema.applications if app.import_path == BUILDER_IMPORT_PATH]
    if not builder_apps:
        raise ValueError(f"config file {path}: no application has import_path {BUILDER_IMPORT_PATH}")
    http = dict(raw.get("http_options") or {})
    configs = []
    for app in builder_apps:
        try:
            config = ServiceConfig(**(app.args or {}))
        except ValidationError as error:
            raise ValueError(f"config file {path}: application {app.name!r} args: {_first_error(error)}") from None
        # Serve's HTTP server is the service's: the args' host/port fill in what http_options leave out.
        for field in ("host", "port"):
            chosen = getattr(config, field)
            if field not in http:
                http[field] = chosen
            elif field in config.model_fields_set and http[field] != chosen:
                raise ValueError(f"config file {path}: application {app.name!r} args.{field} {chosen!r} differs "
                                 f"from http_options.{field} {http[field]!r}; set one of them")
        configs.append(config)
    deploy_config = schema.model_dump(mode="json", exclude_unset=True)
    deploy_config["http_options"] = {**deploy_config.get("http_options", {}), **http}
    host, port = http["host"], int(http["port"])
    base_url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::', '') else host}:{port}"
    apps = tuple(AppTarget(app.name, f"{base_url}{(app.route_prefix or '/').rstrip('/')}/health", dict(app.args or {}),
                           dict(app.runtime_env or {}), config.min_workers_resolved)
                 for app, config in zip(builder_apps, configs))
    return RolloutPlan(deploy_config, host, port, apps)


def _first_error(error: ValidationError) -> str:
    first = error.errors()[0]
    where = ".".join(str(p) for p in first.get("loc", ()))
    return f"{where}: {first['msg']} (got {first.get('input')!r})" if where else first["msg"]


@dataclass(frozen=True, slots=True)
class AppBaseline:
    """An app as it was before the PUT, to tell the new version from the old one.

    Attributes:
        outdated_replica_ids: replicas that run code the new config replaces (empty when the
            import path, args and runtime env stay the same: Serve then keeps its replicas).
        status: the app's status before the PUT; None when it did not exist.
        message: its status message then.
    """

    outdated_replica_ids: frozenset[str]
    status: str | None
    message: str


def baseline_of(details: dict, target: AppTarget) -> AppBaseline:
    """The app `target` as Serve's `details` (taken before the PUT) show it."""
    app = details.get("applications", {}).get(target.name)
    if app is None:
        return AppBaseline(frozenset(), None, "")
    deployed = app.get("deployed_app_config") or {}
    is_same_code = (deployed.get("import_path") == BUILDER_IMPORT_PATH and (deployed.get("args") or {}) == target.args
                    and (deployed.get("runtime_env") or {}) == target.runtime_env)
    ids = set() if is_same_code else {
        r["replica_id"] for d in app.get("deployments", {}).values() for r in d.get("replicas", ())}
    return AppBaseline(frozenset(ids), app.get("status"), app.get("message", ""))


def app_progress(details: dict, target: AppTarget, baseline: AppBaseline) -> tuple[bool, str]:
    """(whether the app runs the new version on every deployment, a short description).

    While Serve builds a new version the app still reports RUNNING on the old replicas, so the
    status alone cannot tell; a deployment counts as rolled out once enough replicas run that did
    not exist before the PUT (old ones may still be draining in STOPPING). Raises RolloutError on
    a deploy failure that is new since the PUT.
    """
    app = details.get("applications", {}).get(target.name)
    if app is None:
        return False, "not created yet"
    status, message = app.get("status"), app.get("message", "")
    if status == "DEPLOY_FAILED" and (baseline.status != "DEPLOY_FAILED" or message != baseline.message):
        raise RolloutError(f"application {target.name!r} failed to deploy: {_last_line(message)}",
                           "the full traceback is in `serve status` and the Serve controller log on the head node")
    parts, is_done = [], status == "RUNNING"
    for name, deployment in sorted(app.get("deployments", {}).items()):
        running = [r["replica_id"] for r in deployment.get("replicas", ()) if r.get("state") == "RUNNING"]
        new = [rid for rid in running if rid not in baseline.outdated_replica_ids]
        wanted = max(1, deployment.get("target_num_replicas", 1))
        is_done = is_done and len(new) >= wanted and len(new) == len(running)
        parts.append(f"{name} {len(new)}/{wanted} new")
    return is_done and bool(parts), f"{status} ({', '.join(parts) or 'building'})"


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "no message"


def probe_health(url: str) -> tuple[int | None, dict]:
    """(HTTP status or None when nothing answers, JSON body or {})."""
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        try:
            return error.code, json.loads(error.read())
        except json.JSONDecodeError:
            return error.code, {}
    except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError):
        return None, {}


def _check_reachable(address: str) -> None:
    """Fail fast on a HOST:PORT nothing listens on (ray.init would retry for minutes)."""
    host, _, port = address.rpartition(":")
    if address == "auto" or "://" in address or not port.isdigit():
        return
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as error:
        raise RolloutError(f"no Ray cluster answers at {address} ({error.strerror or error})",
                           "inside `ray job submit` leave --address at auto; else give the head's GCS HOST:PORT"
                           ) from None


def _say(line: str) -> None:
    print(line, flush=True)  # a job's stdout is a pipe: unflushed progress would arrive at the end


def rollout(plan: RolloutPlan, address: str, timeout_s: float, progress=_say) -> list[str]:
    """Deploy `plan` on the cluster at `address`; returns the apps' URLs once all are healthy."""
    import ray
    from ray.dashboard.modules.serve.sdk import ServeSubmissionClient

    _check_reachable(address)
    context = ray.init(address=address, logging_level="WARNING")
    if not context.dashboard_url:
        raise RolloutError("the Ray cluster runs without a dashboard, which serves the Serve REST API",
                           "start the head node with `ray start --head --include-dashboard true`")
    client = ServeSubmissionClient(f"http://{context.dashboard_url}")
    before = client.get_serve_details()
    baselines = {app.name: baseline_of(before, app) for app in plan.apps}
    progress(f"rollout: deploying {', '.join(a.name for a in plan.apps)} through {context.dashboard_url}")
    try:
        client.deploy_applications(plan.deploy_config)
    except RuntimeError as error:  # the REST API's 4xx/5xx, with Serve's reason
        raise RolloutError(f"Serve refused the config: {_last_line(str(error))}",
                           "the cluster must run Ray 2.60 with Serve; see the dashboard log on the head node") from None
    running_http = client.get_serve_details().get("http_options") or {}
    if running_http and (running_http.get("host"), running_http.get("port")) != (plan.http_host, plan.http_port):
        raise RolloutError(
            f"Serve already runs with HTTP on {running_http.get('host')}:{running_http.get('port')}, the config "
            f"asks for {plan.http_host}:{plan.http_port}; Serve cannot move its HTTP server while it runs",
            "use the running host/port in http_options, or `serve shutdown` first (drops traffic)")
    start_s = time.monotonic()
    deadline_s, next_report_s = start_s + timeout_s, start_s
    while True:
        try:
            details = client.get_serve_details()
        except (RuntimeError, OSError) as error:  # the dashboard restarting; the deadline still holds
            details = {"applications": {}}
            progress(f"rollout: Serve details unavailable ({type(error).__name__}), retrying")
        states, done = [], True
        for app in plan.apps:
            is_new, described = app_progress(details, app, baselines[app.name])
            code, body = probe_health(app.health_url) if is_new else (None, {})
            num_ready = body.get("workers_ready", 0)
            is_healthy = code == 200 and num_ready >= app.num_min_workers
            done = done and is_new and is_healthy
            health = f"/health {code or '-'}, {num_ready}/{app.num_min_workers} workers" if is_new else "/health -"
            states.append(f"{app.name} {described}, {health}")
        now_s = time.monotonic()
        if done:
            progress(f"rollout: healthy after {now_s - start_s:.0f} s: {'; '.join(states)}")
            return [app.health_url.removesuffix("/health") for app in plan.apps]
        if now_s >= deadline_s:
            raise RolloutError(f"not healthy within {timeout_s:.0f} s: {'; '.join(states)}",
                               "check `serve status` and the worker logs; raise --timeout-s if the model loads slowly")
        if now_s >= next_report_s:
            progress(f"rollout: {now_s - start_s:.0f} s: {'; '.join(states)}")
            next_report_s = now_s + PROGRESS_EVERY_S
        time.sleep(POLL_S)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m deploy.rollout",
        description="Deploy or update the S3 Serve application on the Ray cluster this runs in (submit it with "
                    "`ray job submit`), wait until it is healthy and print its URL. Rolling out a changed config "
                    "keeps in-flight requests: the old router drains while the new one takes new requests.")
    parser.add_argument("--config", type=Path, required=True, metavar="FILE",
                        help="Serve config file (applications with import_path cluster.app:build_app; their args "
                             "are cluster.config.ServiceConfig fields), e.g. deploy/serve_config.yaml")
    parser.add_argument("--timeout-s", type=float, default=900.0, metavar="S",
                        help="how long to wait for every application to be healthy, in seconds; loading the model "
                             "on new workers takes most of it (default: %(default)s)")
    parser.add_argument("--address", default="auto",
                        help="Ray cluster to connect to; 'auto' is the cluster this job runs in (RAY_ADDRESS) or "
                             "the one started on this machine (default: %(default)s)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        plan = load_plan(args.config)
    except ValueError as error:
        print(f"rollout: error: invalid config: {error}", file=sys.stderr)
        print("hint: the args are cluster.config.ServiceConfig fields; see `s3serve serve --help`", file=sys.stderr)
        return 2
    try:
        urls = rollout(plan, args.address, args.timeout_s)
    except RolloutError as error:
        print(f"rollout: error: {error}", file=sys.stderr)
        print(f"hint: {error.hint}", file=sys.stderr)
        return 1
    except (OSError, RuntimeError) as error:  # no cluster, or its dashboard does not answer
        print(f"rollout: error: {type(error).__name__}: {_last_line(str(error))}", file=sys.stderr)
        print(f"hint: is a Ray cluster with a dashboard running at {args.address!r}?", file=sys.stderr)
        return 1
    for url in urls:
        _say(f"S3 Serve is ready at {url}  (OpenAI API: {url}/v1)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
