"""The service's start and stop: a local Ray cluster (or the one already there), Redis, the Serve app.

    check the model (and a remote Redis) -> start_local_ray (num_cpus) -> Redis ($S3_REDIS_URL or embedded, persistent
    in data_dir) -> serve.start(host, port) -> serve.run(build_app) -> poll /health -> RunningService
    stop_service: controller.shutdown (kills the detached workers) -> serve.shutdown -> ray.shutdown -> Redis stop

`s3serve serve` (`s3serve_cli/serve.py`) prints the ready message around it and waits for Ctrl-C; the benches and
tests that run the whole service call it directly.
"""

import json
import os
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from cluster.config import CONTROLLER_NAME, RAY_NAMESPACE, ServiceConfig
from cluster.local_ray import start_local_ray
from cluster.start_error import ServiceStartError

APP_NAME = "s3serve"


def wait_until_healthy(base_url: str, timeout_s: float, api_key: str | None = None, progress=print,
                       progress_every_s: float = 15.0, started_s: float | None = None) -> dict:
    """Poll /health until it answers 200, saying what it waits for (again every `progress_every_s`);
    raise TimeoutError with its last answer otherwise. `timeout_s` counts from `started_s` (time.monotonic();
    now by default), so a start-up's earlier steps spend the same budget."""
    start_s = time.monotonic() if started_s is None else started_s
    deadline = start_s + timeout_s
    last = "no answer yet"
    last_note, last_said_s = None, start_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=5) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as error:
            last = error.read().decode(errors="replace")
        except (urllib.error.URLError, ConnectionError, TimeoutError) as error:
            last = str(error)
        note = "loading the model on the workers" if "workers_ready" in last else "starting the HTTP server"
        now_s = time.monotonic()
        if note != last_note or now_s - last_said_s >= progress_every_s:
            progress(f"  ... {note} ({now_s - start_s:.0f} s of at most {timeout_s:.0f} s)")
            last_note, last_said_s = note, now_s
        time.sleep(1.0)
    raise TimeoutError(f"the service did not become healthy within {timeout_s:.0f} s (raise --start-timeout on a "
                       f"busy or slow machine); last /health: {' '.join(last.split())[:300]}")


@dataclass
class RunningService:
    """What `start_service` brought up; `stop_service` takes it down."""

    config: ServiceConfig
    base_url: str
    redis_url: str
    redis: "RedisSupervisor | None"  # the embedded Redis and its watchdog; None with a remote Redis
    health: dict


def _check_deadline(started_s: float, timeout_s: float, done: str) -> None:
    """Give up between start-up steps once `timeout_s` since `started_s` have passed (--start-timeout counts the
    whole start-up, not only the wait for /health)."""
    if time.monotonic() - started_s >= timeout_s:
        raise TimeoutError(f"the service did not start within {timeout_s:.0f} s (raise --start-timeout on a busy or "
                           f"slow machine); it had got as far as {done}")


def start_serve(http_options: dict, deadline_s: float, progress=print) -> None:
    """`serve.start`, waiting for its HTTP proxy until `deadline_s` (time.monotonic()) rather than Serve's fixed
    60 s: on a busy machine the proxy is still starting then, and a second `serve.start` finds the controller that
    the first one left running (the proxy's readiness is then seen through /health)."""
    from ray import serve

    while True:
        try:
            serve.start(http_options=http_options)
            return
        except TimeoutError as error:
            if "HTTP proxies not available" not in str(error) or time.monotonic() >= deadline_s:
                raise
            progress("  ... Serve's HTTP proxy is still starting (a busy machine); waiting for it")


def start_service(config: ServiceConfig, ready_timeout_s: float = 900.0, progress=print) -> RunningService:
    """Ray (local, unless already initialised), Redis, the Serve app; returns once /health answers 200.

    Raises `ServiceStartError` (one line: the step and its cause) or TimeoutError after `ready_timeout_s`.
    """
    import ray
    from ray import serve

    from cluster.app import build_app
    from cluster.context_length import resolve_max_model_len
    from cluster.control.redis_server import EmbeddedRedis
    from cluster.control.redis_supervisor import RedisSupervisor

    started_s = time.monotonic()
    data_dir = Path(config.data_dir).expanduser().resolve()
    config = config.model_copy(update={"data_dir": str(data_dir)})
    redis = None
    try:  # before anything starts: nothing to stop when it fails
        check_model(config)
        config, source = resolve_max_model_len(config)
        if source != "configured":
            progress(f"s3serve: max_model_len {config.max_model_len:,} ({source})")
    except (ValueError, FileNotFoundError):
        raise
    except Exception as error:  # e.g. a config.json transformers cannot read
        raise ServiceStartError(f"start-up failed while checking the model {config.model}: "
                                f"{type(error).__name__}: {_first_line(error)}") from error
    if config.redis_url_resolved is not None:
        check_redis(config.redis_url_resolved)
    step = "starting a local Ray cluster"
    try:
        if not ray.is_initialized():
            num_cpus = config.num_cpus or 2 * (os.cpu_count() or 1)
            progress(f"s3serve: starting a local Ray cluster ({num_cpus} logical CPUs)")
            start_local_ray(num_cpus, progress)
            _check_deadline(started_s, ready_timeout_s, "starting Ray")
        redis_url = config.redis_url_resolved
        if redis_url is None:
            step = f"starting the embedded Redis in {data_dir / 'redis'}"
            redis = RedisSupervisor(EmbeddedRedis(data_dir / "redis"))  # restarted if it dies
            redis_url = redis.start()
            progress(f"s3serve: embedded Redis at {redis_url} (data in {data_dir / 'redis'})")
            _check_deadline(started_s, ready_timeout_s, "starting Redis")
        config = config.model_copy(update={"redis_url": redis_url})
        step = f"starting Serve's HTTP proxy on {config.host}:{config.port}"
        progress(f"s3serve: {step}")
        start_serve({"host": config.host, "port": config.port}, started_s + ready_timeout_s, progress)
        _check_deadline(started_s, ready_timeout_s, "starting Serve's HTTP proxy")
        step = "deploying the router"
        progress(f"s3serve: {step} (it loads the length predictor and the tokenizer)")
        serve.run(build_app(config.model_dump()), name=APP_NAME, route_prefix="/", blocking=False)
        base_url = f"http://{'127.0.0.1' if config.host in ('0.0.0.0', '::') else config.host}:{config.port}"
        progress(f"s3serve: waiting for {config.num_workers} worker(s) to load {config.model}")
        step = "waiting for the service to become healthy"
        health = wait_until_healthy(base_url, ready_timeout_s, progress=progress, started_s=started_s)
    except BaseException as error:
        _stop_quietly(RunningService(config, "", "", redis, {}))
        if isinstance(error, Exception) and not isinstance(error, (TimeoutError, ValueError)):
            raise ServiceStartError(f"start-up failed while {step}: {type(error).__name__}: "
                                    f"{_first_line(error)}") from error
        raise
    return RunningService(config, base_url, redis_url, redis, health)


def check_redis(url: str, max_retry_s: float = 3.0) -> None:
    """Fail before anything starts when the configured Redis does not answer or refuses the URL's password (one
    line, the password shown as ***), instead of every replica retrying it in its own log."""
    import redis

    from cluster.control.redis_server import connect, is_untrusted_certificate, redacted_url

    client = connect(url, max_retry_s=max_retry_s)
    try:
        client.ping()
    except redis.RedisError as error:
        where, reason = f"start-up failed: Redis at {redacted_url(url)}", _first_line(error)
        if isinstance(error, redis.AuthenticationError):
            raise ServiceStartError(f"{where} refused the credentials: {reason}") from error
        if is_untrusted_certificate(error):
            advice = ("give the CA that signed it as redis_ca_file (--redis-ca-file)"
                      if any(word in reason.lower() for word in ("issuer", "self-signed", "self signed"))
                      else "check the certificate's host names and dates, or give its CA as --redis-ca-file")
            raise ServiceStartError(f"{where} presented a TLS certificate that does not verify ({reason}): "
                                    f"{advice}") from error
        raise ServiceStartError(f"{where} does not answer: {type(error).__name__}: {reason}") from error
    finally:
        client.close()


def check_model(config: ServiceConfig) -> None:
    """Fail before anything starts where every worker would fail the same way: a model that is not there, or one
    our engine cannot serve correctly (`workers.values.model_support`), instead of inside a Serve replica's
    traceback."""
    from transformers import AutoConfig

    from workers.engine.models import load_tokenizer, resolve_model_dir, resolve_tokenizer_dir
    from workers.values.model_support import check_servable

    cache_dir = Path(config.model_cache_dir) if config.model_cache_dir else None
    model_dir = resolve_model_dir(config.model, cache_dir, config.revision)
    model_config = AutoConfig.from_pretrained(model_dir)
    check_servable(model_config, config.model)
    if config.tokenizer is not None:
        tokenizer = load_tokenizer(resolve_tokenizer_dir(config.tokenizer, model_dir, cache_dir))
        vocab_size = getattr(model_config.get_text_config(), "vocab_size", None)
        if vocab_size is not None and len(tokenizer) > vocab_size:
            raise ValueError(f"tokenizer {config.tokenizer!r} has {len(tokenizer):,} tokens, more than model "
                             f"{config.model!r}'s vocabulary of {vocab_size:,}: they do not belong together")


def _first_line(error: BaseException) -> str:
    """The message's first line, and its last when it has several (a log tail ends with the reason)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if not lines:
        return "(no message)"
    return lines[0][:300] if len(lines) == 1 else f"{lines[0][:200]} ... {lines[-1][:200]}"


def _stop_quietly(service: RunningService) -> None:
    """Take down what a failed start brought up, without letting a second error hide the first."""
    try:
        stop_service(service)
    except Exception as error:  # noqa: BLE001 - the start-up error is the one to report
        print(f"s3serve: cleaning up after the failed start: {type(error).__name__}", file=sys.stderr)


def stop_service(service: RunningService) -> None:
    """Kill the workers (detached, so nothing else would), the Serve app, Ray, then the embedded Redis."""
    import ray

    try:
        if ray.is_initialized():  # else start-up failed before Ray ran, and Serve's shutdown would start a cluster
            _stop_ray()
    finally:
        if service.redis is not None:
            service.redis.stop()


def _stop_ray() -> None:
    """The controller (and with it the workers), Serve, then Ray itself, each even when the one before failed."""
    import ray
    from ray import serve

    try:
        controller = ray.get_actor(CONTROLLER_NAME, namespace=RAY_NAMESPACE)
        ray.get(controller.shutdown.remote(), timeout=30)
        ray.kill(controller, no_restart=True)
    except ValueError:
        pass  # no actor by that name: start-up gave up before the router created it
    except Exception as error:  # noqa: BLE001 - stopping must go on whatever is already gone
        print(f"s3serve: controller already gone ({type(error).__name__})", file=sys.stderr)
    try:
        serve.shutdown()
    finally:
        ray.shutdown()
