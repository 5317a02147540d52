"""`s3serve bench soak`: the real service for N minutes at 80% of its measured capacity, a few faults spread
through the middle of the run; does anything grow?

    start the service as `bench chaos` does (real Ray, embedded Redis, two SmolLM2 workers)
    -> each prompt answered alone: the reference text every answer must repeat (`chaos_bench.reference_digests`)
    -> capacity: `capacity_requests` chats sent at once, whole answers per second
    -> `python -m benchmarks.http_load` at `load_fraction` x capacity for `minutes`: streamed chats, whole-body
       chats and chats whose client hangs up after a few tokens, in a fixed mix; the faults evenly between the
       end of the second minute and the start of the last, so both stay quiet
    -> every `sample_s`: resident memory of each service process, their open file descriptors, Redis's keys
    -> per minute: sent, whole, cancelled, refused, lost, latency p50/p99, memory, descriptors, keys; the growth
       from the second minute (the first warms up) to the last
"""

import asyncio
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import psutil

from benchmarks.chaos_accounting import LOST_FATES, SOAK_FAULTS, fate
from benchmarks.chaos_bench import PROMPTS, inject, reference_digests
from benchmarks.service_under_test import ServiceUnderTest, bench_service
from benchmarks.http_load import LoadPlan, LoadRequest, drive, read_results, read_start_unix_s, write_plan
from benchmarks.report import environment, format_table, write_json

MIX = ("stream",) * 6 + ("whole",) * 3 + ("cancel",)  # by request index, repeating
CANCEL_AFTER_EVENTS = 3
TARGETS = {"lost": 0, "rss_growth": 0.05, "fds_growth": 0, "p99_drift": 0.20}


@dataclass(frozen=True)
class SoakBenchConfig:
    """The run's shape.

    Attributes:
        minutes: how long the load runs.
        load_fraction: the load's rate as a share of the measured capacity.
        max_tokens: tokens per answer (forced: greedy, ignore_eos).
        faults: names from `SOAK_FAULTS`, injected in this order.
        capacity_requests: chats sent at once to measure the capacity.
        sample_s: seconds between samples of memory, descriptors and keys.
        stop_s, burst_factor, recovery_timeout_s: the faults' settings, as in `ChaosBenchConfig`.
        num_workers, max_concurrent_requests, num_cpus, dtype, ready_timeout_s: the service (float32, as in
            `ChaosBenchConfig`, so the content check sees faults, not a batch's rounding).
    """

    minutes: float = 20.0
    load_fraction: float = 0.8
    max_tokens: int = 32
    faults: tuple[str, ...] = ("kill_worker", "kill_redis", "stop_worker")
    capacity_requests: int = 48
    sample_s: float = 10.0
    stop_s: float = 10.0
    burst_factor: int = 10
    recovery_timeout_s: float = 60.0
    num_workers: int = 2
    max_concurrent_requests: int = 32
    num_cpus: int = 8
    dtype: str = "float32"
    ready_timeout_s: float = 900.0

    def __post_init__(self) -> None:
        unknown = [name for name in self.faults if name not in SOAK_FAULTS]
        if unknown:
            raise ValueError(f"unknown faults {unknown}; choose from {list(SOAK_FAULTS)}")
        if self.minutes < 5:
            raise ValueError(f"minutes must be >= 5 (a warm-up minute, a quiet second one, the faults, a minute to "
                             f"drain, a quiet last one), got {self.minutes}")
        if not 0 < self.load_fraction <= 1 or self.max_tokens < 1 or self.capacity_requests < 1:
            raise ValueError("load_fraction must be in (0, 1]; max_tokens and capacity_requests positive")


def quick_config(**overrides) -> SoakBenchConfig:
    """Five minutes of load (about eight with start-up and the capacity measurement)."""
    return replace(SoakBenchConfig(minutes=5.0, capacity_requests=32), **overrides)


def fault_times_s(config: SoakBenchConfig) -> list[float]:
    """When each fault is injected, seconds after the load starts: evenly inside [120 s, a minute before the last
    minute's start), so the backlog a fault leaves drains before the last minute (at 80% load it drains at a
    fifth of the rate it built up)."""
    span_s = (config.minutes - 2) * 60.0 - 120.0
    return [120.0 + (index + 0.5) * span_s / len(config.faults) for index in range(len(config.faults))]


def load_plan(config: SoakBenchConfig, base_url: str, model_id: str, rate_per_s: float) -> LoadPlan:
    """Chats at `rate_per_s` for the whole run, in `MIX`'s kinds."""
    requests = []
    for index in range(int(config.minutes * 60.0 * rate_per_s)):
        kind = MIX[index % len(MIX)]
        requests.append(LoadRequest(f"soak-{index}", index / rate_per_s, PROMPTS[index % len(PROMPTS)], 0,
                                    config.max_tokens, config.max_tokens, stream=kind != "whole",
                                    cancel_after_events=CANCEL_AFTER_EVENTS if kind == "cancel" else None))
    return LoadPlan(base_url, model_id, 4 * config.max_concurrent_requests, tuple(requests), endpoint="chat")


def measure_capacity(config: SoakBenchConfig, base_url: str, model_id: str) -> float:
    """Whole answers per second with `capacity_requests` chats sent at once."""
    requests = tuple(LoadRequest(f"capacity-{i}", 0.0, PROMPTS[i % len(PROMPTS)], 0, config.max_tokens,
                                 config.max_tokens) for i in range(config.capacity_requests))
    results = asyncio.run(drive(LoadPlan(base_url, model_id, config.capacity_requests, requests, endpoint="chat")))
    whole = [r for r in results if r.is_ok]
    if not whole:
        raise RuntimeError(f"no capacity request completed: {results[0].status_code} {results[0].error}")
    return len(whole) / (max(r.finished_s for r in whole) - min(r.sent_s for r in results))


def process_label(process: psutil.Process) -> str:
    """A service process's kind: Ray's title (`ray::WorkerActor`, `ray::ServeReplica:s3serve:router`), else its
    program's name (`raylet`, `gcs_server`, `redis-server`)."""
    words = process.cmdline() or [process.name()]
    return words[0] if words[0].startswith("ray::") else Path(words[0]).name


def sample(service: ServiceUnderTest, redis_keys) -> dict:
    """The service's processes now (the load generator left out): memory by kind, descriptors, Redis's keys."""
    rss_by_kind: dict[str, float] = {}
    fds = 0
    for process in service.processes():
        try:
            with process.oneshot():
                label, rss_mib, num_fds = process_label(process), process.memory_info().rss / 2**20, process.num_fds()
        except psutil.Error:
            continue  # ended meanwhile
        rss_by_kind[label] = rss_by_kind.get(label, 0.0) + rss_mib
        fds += num_fds
    keys, keys_without_ttl = redis_keys()
    return {"unix_s": time.time(), "rss_mib": sum(rss_by_kind.values()), "rss_mib_by_kind": rss_by_kind,
            "open_fds": fds, "redis_keys": keys, "redis_keys_without_ttl": keys_without_ttl}


def minute_rows(results: list, start_unix_s: float, samples: list[dict], references: dict[str, str],
                max_tokens: int, minutes: int) -> list[dict]:
    """Per minute of the load: the requests sent in it by fate, their latency, and the last sample in it."""
    rows = []
    for minute in range(minutes):
        sent = [r for r in results if minute * 60.0 <= r.sent_s < (minute + 1) * 60.0]
        fates = [fate(r, max_tokens, references.get(r.request_id)) for r in sent]
        latencies = sorted(r.finished_s - r.sent_s for r, kind in zip(sent, fates) if kind == "whole")
        inside = [s for s in samples if minute * 60.0 <= s["unix_s"] - start_unix_s < (minute + 1) * 60.0]
        last = inside[-1] if inside else dict.fromkeys(("rss_mib", "open_fds", "redis_keys", "redis_keys_without_ttl"))
        rows.append({"minute": minute + 1, "sent": len(sent), "whole": fates.count("whole"),
                     "cancelled": fates.count("cancelled"), "refused": fates.count("refused"),
                     "corrupted": fates.count("corrupted"),
                     "lost": sum(kind in LOST_FATES for kind in fates),
                     "latency_p50_s": _quantile(latencies, 0.50), "latency_p99_s": _quantile(latencies, 0.99),
                     "rss_mib": last["rss_mib"], "open_fds": last["open_fds"], "redis_keys": last["redis_keys"],
                     "redis_keys_without_ttl": last.get("redis_keys_without_ttl")})
    return rows


def _quantile(values: list[float], q: float) -> float | None:
    if len(values) < 2:
        return values[0] if values else None
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def growth(rows: list[dict]) -> dict:
    """From the second minute to the last: memory and p99 as ratios less one, descriptors and keys as counts (keys
    with a time to live, such as the one-hour markers of counted requests, grow until they expire; those without
    must not)."""
    second, last = rows[1], rows[-1]

    def ratio(key: str) -> float | None:
        return None if not second[key] or last[key] is None else last[key] / second[key] - 1.0

    def change(key: str) -> int | None:
        return None if second[key] is None or last[key] is None else last[key] - second[key]

    return {"rss_growth": ratio("rss_mib"), "p99_drift": ratio("latency_p99_s"), "fds_growth": change("open_fds"),
            "redis_keys_growth": change("redis_keys"),
            "redis_keys_without_ttl_growth": change("redis_keys_without_ttl")}


def run(config: SoakBenchConfig, model_name: str = "smollm2-135m-instruct", model_cache_dir: Path | None = None,
        json_path: Path | None = None) -> dict:
    """Start the service, measure its capacity, soak it, print the table, write JSON."""
    with tempfile.TemporaryDirectory(prefix="s3serve-soak-") as work:
        with bench_service(config, model_name, model_cache_dir, Path(work), "soak") as running:
            result = _soak(config, running, Path(work))
    result["environment"] = environment()
    _print(result)
    write_json(json_path, result)
    return result


def _soak(config: SoakBenchConfig, running, work_dir: Path) -> dict:
    import redis

    model_id = running.config.model_id
    reference_by_prompt = reference_digests(config, running.base_url, model_id)
    capacity_per_s = measure_capacity(config, running.base_url, model_id)
    rate_per_s = config.load_fraction * capacity_per_s
    print(f"soak: capacity {capacity_per_s:.2f} chats/s; {config.minutes:g} minutes at {rate_per_s:.2f}/s",
          flush=True)
    plan = load_plan(config, running.base_url, model_id, rate_per_s)
    plan_path, results_path = work_dir / "plan.json", work_dir / "results.json"
    write_plan(plan_path, plan)
    keys_client = redis.Redis.from_url(running.redis_url, socket_timeout=2.0)

    def redis_keys() -> tuple[int | None, int | None]:
        """All keys, and those without a time to live."""
        try:
            space = keys_client.info("keyspace").get("db0", {"keys": 0, "expires": 0})
            return int(space["keys"]), int(space["keys"]) - int(space["expires"])
        except redis.RedisError:
            return None, None  # down for a fault

    load = subprocess.Popen([sys.executable, "-m", "benchmarks.http_load", "--plan", str(plan_path),
                             "--out", str(results_path), "--desc", "soak load"])
    service = ServiceUnderTest(running, config, load.pid)
    launched_s, samples, done = time.monotonic(), [], threading.Event()

    def sampler() -> None:
        while not done.wait(0 if not samples else config.sample_s):
            samples.append(sample(service, redis_keys))

    thread = threading.Thread(target=sampler, daemon=True)
    thread.start()
    faults, burst_results = [], []
    for name, at_s in zip(config.faults, fault_times_s(config)):
        time.sleep(max(0.0, launched_s + at_s - time.monotonic()))
        print(f"soak: {name}", flush=True)
        start_s = time.monotonic()
        inject(name, service, burst_results)
        recovery_s = service.recovery_s(start_s)
        faults.append({"name": name, "at_s": round(at_s, 1), "recovery_s": recovery_s})
    if load.wait(timeout=config.minutes * 60.0 + 900.0) != 0:
        raise RuntimeError(f"the load generator exited with {load.returncode} (its error is printed above)")
    done.set()
    thread.join(timeout=60)
    start_unix_s = read_start_unix_s(results_path)
    results = read_results(results_path)
    references = {r.request_id: reference_by_prompt[r.prompt] for r in plan.requests}
    rows = minute_rows(results, start_unix_s, samples, references, config.max_tokens, int(config.minutes))
    totals = {key: sum(row[key] for row in rows) for key in ("sent", "whole", "cancelled", "refused", "corrupted",
                                                             "lost")}
    return {"benchmark": "soak", "config": asdict(config), "capacity_per_s": capacity_per_s,
            "rate_per_s": rate_per_s, "faults": faults, "totals": totals,
            "soak": {"minutes": rows, **growth(rows), "last_sample": samples[-1] if samples else None},
            "targets": TARGETS}


def _cell(value, digits: int = 2):
    return "-" if value is None else round(float(value), digits)


def _print(result: dict) -> None:
    headers = ["minute", "sent", "whole", "cancel", "refused", "corrupt", "lost", "lat_p50_s", "lat_p99_s",
               "rss_MiB", "fds", "redis_keys", "no_ttl"]
    rows = [[r["minute"], r["sent"], r["whole"], r["cancelled"], r["refused"], r["corrupted"], r["lost"],
             _cell(r["latency_p50_s"]), _cell(r["latency_p99_s"]), _cell(r["rss_mib"], 0), _cell(r["open_fds"], 0),
             _cell(r["redis_keys"], 0), _cell(r["redis_keys_without_ttl"], 0)] for r in result["soak"]["minutes"]]
    print(format_table(headers, rows))
    print("faults: " + ", ".join(f"{f['name']} at {f['at_s']:.0f} s (recovered in "
                                 + ("never" if f["recovery_s"] is None else f"{f['recovery_s']:.1f} s") + ")"
                                 for f in result["faults"]))
    soak, t = result["soak"], result["totals"]

    def percent(value) -> str:
        return "n/a" if value is None else f"{value * 100:+.1f}%"

    def signed(value) -> str:
        return "n/a" if value is None else f"{value:+d}"

    print(f"totals: {t['sent']} sent, {t['whole']} whole, {t['cancelled']} cancelled by the client, {t['refused']} "
          f"refused with Retry-After, {t['lost']} lost ({t['corrupted']} corrupted)")
    print(f"minute 2 -> {len(soak['minutes'])}: memory {percent(soak['rss_growth'])}, open descriptors "
          f"{signed(soak['fds_growth'])}, Redis keys {signed(soak['redis_keys_growth'])} (without a time to live "
          f"{signed(soak['redis_keys_without_ttl_growth'])}), latency p99 "
          f"{percent(soak['p99_drift'])}")
    print("targets: 0 lost, memory growth <= 5%, descriptors flat, p99 of the last minute within 20% of minute 2")
