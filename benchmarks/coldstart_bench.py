"""A length predictor's cold start, through the service: served for a model no artifact was trained for, it starts
from the max_tokens prior, retrains on its own finished requests and promotes a learnt version.

    s3serve bench coldstart [--model DIR] [--num-requests N] [--quick] [--json out.json]

Starts `s3serve serve` (retraining on, every `retrain_min_samples` finished requests, the service's default 200),
sends pool prompts (seeded order, none repeated) as greedy streamed chats and watches the retrainer's attempts
(what it exports to Redis). Each promoted version is then scored on the requests that finished after it was trained,
which it never saw, against the prior the routers served until then, on the same requests: Kendall tau, bucket
accuracy, MAE and under-reservation. The default model is SmolLM2 from its converted folder, passed as a path: the
service cannot tell it from any user's model, so the shipped SmolLM2 predictor stays unused and the run starts cold
(the lengths the shipped artifact learnt are SmolLM2's own; Gemma 3 270M, a base model, runs nearly every answer to
max_tokens, which leaves nothing to rank).
"""

import asyncio
import json
import random
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from benchmarks.http_load import LoadPlan, LoadRequest, drive
from benchmarks.prompt_pool import DEFAULT_PROMPTS, read_prompts
from benchmarks.report import environment, format_table, write_json
from cluster.config import service_default
from workers.actors.ports import free_port


@dataclass(frozen=True, slots=True)
class ColdStartConfig:
    """One cold start.

    Attributes:
        num_requests: chats sent, each a different pool prompt.
        concurrency: most requests in flight.
        max_tokens: each request's limit (greedy; most answers stop before it).
        retrain_min_samples: finished requests between retraining attempts (the service's setting).
        num_workers, num_cpus: the service's workers and the local Ray cluster's CPUs.
        prompts_path: the prompt pool.
        seed: the prompts' order.
        ready_timeout_s: how long the service may take to start.
    """

    num_requests: int = 640
    concurrency: int = 32
    max_tokens: int = 512
    retrain_min_samples: int = service_default("retrain_min_samples")
    num_workers: int = service_default("num_workers")
    num_cpus: int = 4
    prompts_path: str = str(DEFAULT_PROMPTS)
    seed: int = 0
    ready_timeout_s: float = 900.0


def quick_config() -> ColdStartConfig:
    return ColdStartConfig(num_requests=360, max_tokens=256, retrain_min_samples=120)


def load_plan(config: ColdStartConfig, base_url: str, model_id: str) -> LoadPlan:
    records = read_prompts(config.prompts_path)
    if len(records) < config.num_requests:
        raise ValueError(f"{config.prompts_path} holds {len(records)} prompts, fewer than {config.num_requests}")
    chosen = random.Random(config.seed).sample(records, config.num_requests)
    requests = tuple(LoadRequest(r.prompt_id, 0.0, r.text, 0, config.max_tokens, None, messages=r.messages)
                     for r in chosen)
    return LoadPlan(base_url, model_id, config.concurrency, requests, endpoint="chat")


def watch_attempts(redis_url: str, stop: threading.Event, attempts: list[dict], poll_s: float = 1.0) -> None:
    """Record each retraining attempt the retrainer exports (a new `at_unix_s`)."""
    import redis

    from predictor_service.retraining import RETRAIN_EXPORT_KEY

    client = redis.Redis.from_url(redis_url, decode_responses=True)
    seen = None
    while not stop.wait(poll_s):
        fields = client.hgetall(RETRAIN_EXPORT_KEY)
        if fields and fields.get("at_unix_s") != seen:
            seen = fields["at_unix_s"]
            attempts.append({"promoted": fields["promoted"] == "1", "reason": fields["reason"],
                             "version_dir": fields["version_dir"] or None,
                             "num_samples": int(fields["num_train"]) + int(fields["num_window"]),
                             "candidate_window": json.loads(fields["candidate_metrics"]),
                             "active_window": json.loads(fields["active_metrics"])})


def score_versions(attempts: list[dict], samples: list, max_len: int) -> list[dict]:
    """Per attempt: the promoted version and the prior on the samples after the ones it had (unseen)."""
    from predictor_service.artifacts import load_predictor
    from predictor_service.baselines import MaxTokensPrior
    from predictor_service.metrics import evaluate

    rows = []
    for number, attempt in enumerate(attempts, 1):
        row = {"attempt": number, "num_samples": attempt["num_samples"], "promoted": attempt["promoted"],
               "reason": attempt["reason"], "num_unseen": 0}
        unseen = samples[attempt["num_samples"]:]
        if attempt["promoted"] and unseen:
            examples, lengths = [s.example() for s in unseen], [s.true_output_tokens for s in unseen]
            version = load_predictor(Path(attempt["version_dir"]))
            row |= {"num_unseen": len(unseen), "version": evaluate(version.predict_examples(examples), lengths, max_len),
                    "prior": evaluate(MaxTokensPrior(max_len).predict_examples(examples), lengths, max_len)}
        rows.append(row)
    return rows


def run(config: ColdStartConfig, model: str | None = None, model_cache_dir: Path | None = None,
        json_path: Path | None = None) -> dict:
    """Start the service cold, send the load, print the table, write JSON."""
    import redis

    from cluster.config import ServiceConfig
    from predictor_service.sample_stream import SampleStream
    from cluster.local_ray import start_local_ray
    from cluster.service import start_service, stop_service
    from workers.engine.models import DEFAULT_MODEL, resolve_model_dir
    from workers.scheduling.policies import length_range_tokens

    model = model or str(resolve_model_dir(DEFAULT_MODEL, model_cache_dir))  # as a path: no artifact is for it
    with tempfile.TemporaryDirectory(prefix="s3serve-coldstart-") as work:
        service_config = ServiceConfig(
            port=free_port(), model=model, model_cache_dir=str(model_cache_dir) if model_cache_dir else None,
            data_dir=str(Path(work) / "data"), num_workers=config.num_workers,
            retrain=True, retrain_min_samples=config.retrain_min_samples)
        print(f"coldstart: starting the service for {model} (retraining every {config.retrain_min_samples} "
              "finished requests)", flush=True)
        start_local_ray(config.num_cpus, log_to_driver=False)
        running = start_service(service_config, config.ready_timeout_s, progress=lambda _msg: None)
        attempts: list[dict] = []
        stop = threading.Event()
        watcher = threading.Thread(target=watch_attempts, args=(running.redis_url, stop, attempts), daemon=True)
        try:
            watcher.start()
            plan = load_plan(config, running.base_url, running.config.model_id)
            start_s = time.monotonic()
            with tqdm(total=len(plan.requests), desc="coldstart", unit="request") as progress:
                results = asyncio.run(drive(plan, progress))
            elapsed_s = time.monotonic() - start_s
            time.sleep(5.0)  # the last finished requests reach the stream; a last attempt may be under way
            samples = [s for _, s in SampleStream(redis.Redis.from_url(running.redis_url)).read()]
            stop.set()
            watcher.join(timeout=10)
            max_len = length_range_tokens(running.config.max_model_len)
            rows = score_versions(attempts, samples, max_len)
        finally:
            stop.set()
            stop_service(running)
    failed = sum(not r.is_ok for r in results)
    result = {"benchmark": "coldstart", "config": asdict(config), "model": model, "num_failed": failed,
              "num_samples": len(samples), "elapsed_s": elapsed_s, "max_len": max_len, "attempts": rows,
              "environment": environment()}
    _print(result)
    write_json(json_path, result)
    return result


def _print(result: dict) -> None:
    print(f"\n{result['num_samples']} finished requests recorded ({result['num_failed']} failed) in "
          f"{result['elapsed_s']:.0f} s; buckets over {result['max_len']} tokens")
    headers = ["attempt", "samples", "promoted", "unseen", "tau", "prior_tau", "bucket_acc", "prior_acc", "mae",
               "prior_mae", "under", "prior_under"]
    table = []
    for row in result["attempts"]:
        version, prior = row.get("version") or {}, row.get("prior") or {}
        cells = [row["attempt"], row["num_samples"], "yes" if row["promoted"] else "no", row["num_unseen"]]
        for key in ("kendall_tau", "bucket_accuracy", "mae_tokens", "under_reservation_rate"):
            cells += [_fmt(version.get(key)), _fmt(prior.get(key))]
        table.append(cells)
    print(format_table(headers, table))
    for row in result["attempts"]:
        if not row["promoted"]:
            print(f"attempt {row['attempt']} at {row['num_samples']} samples: {row['reason']}")
    first = next((row for row in result["attempts"] if row["promoted"]), None)
    print("no version was promoted" if first is None else
          f"first promotion after {first['num_samples']} finished requests")


def _fmt(value) -> str:
    if value is None:
        return "-"
    return f"{value:.3f}" if isinstance(value, float) else str(value)
