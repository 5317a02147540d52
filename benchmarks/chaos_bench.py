"""`s3serve bench chaos`: the real service under steady load while faults are injected; what each one cost.

    start the service (real Ray, embedded Redis under its supervisor, SmolLM2 workers)
    -> `python -m benchmarks.http_load` in its own process: streamed chats at a fixed rate for the whole run
    -> a quiet window, then one fault per window:
         kill_worker      SIGKILL a worker process (its streams fail over to another worker)
         kill_redis       SIGKILL the embedded redis-server (the supervisor restarts it)
         kill_controller  SIGKILL the controller actor's process (Ray restarts it; it reloads from Redis)
         stop_worker      SIGSTOP a worker for `stop_s`, then SIGCONT
         stop_redis       SIGSTOP the embedded redis-server for `stop_s` (slow, not dead), then SIGCONT
         stop_controller  SIGSTOP the controller for `stop_s`, then SIGCONT
         kill_router      SIGKILL a router replica's process (Serve starts another)
         redis_disk_full  fill the disk under the embedded Redis's append-only file for `stop_s`, then free it
                          (a tmpfs of `redis_disk_mib`, mounted before the service starts: needs root; left out,
                          with the reason printed and in the JSON, where it cannot be mounted)
         burst            `burst_factor` x the service's concurrency limit of extra chats at once
       per fault: time until /health is 200 and a probe request completes, and the service's memory
    -> per fault window: requests sent, completed whole, refused with Retry-After, failed by status,
       duplicated, truncated, corrupted, lost (`benchmarks.chaos_accounting`)

Every answer is greedy with `ignore_eos` and a fixed `max_tokens`, so a whole answer has exactly
that many tokens and anything else is visible. Before the load starts, each prompt is answered once, alone
and without faults: that text is the reference every answer of the run must repeat (else it is corrupted).
"""

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from benchmarks.chaos_accounting import FAULTS, FaultEvent, fault_rows, totals
from benchmarks.http_load import LoadPlan, LoadRequest, drive, read_results, read_start_unix_s, write_plan
from benchmarks.report import environment, format_table, write_json
from benchmarks.service_under_test import ServiceUnderTest, bench_service, redis_data_dir
from benchmarks.small_disk import SmallDisk, SmallDiskUnavailable

PROMPTS = ("Write a short poem about the sea.", "Explain what a hash table is.", "List three uses of copper.",
           "Describe a sunrise in the mountains.", "Give advice to a new programmer.")
TARGETS = {"lost": 0, "duplicated": 0, "truncated": 0, "corrupted": 0, "max_recovery_s": 15.0, "memory_growth": 0.10}


@dataclass(frozen=True)
class ChaosBenchConfig:
    """The run's shape.

    Attributes:
        faults: names from `FAULTS`, in the order they are injected.
        rate_per_s: chats per second from the load process, for the whole run.
        max_tokens: tokens per answer (forced: greedy, ignore_eos).
        window_s: seconds between faults (each fault's requests are those sent in its window).
        warmup_s: load before the quiet window starts (not counted).
        stop_s: how long the stop_* faults keep their process stopped, and redis_disk_full its disk full.
        burst_factor: the burst's size, in multiples of `max_concurrent_requests`.
        num_workers, max_concurrent_requests, num_cpus: the service.
        dtype: the workers' weights and KV. float32 by default: in bf16 the shape of a batch changes some greedy
            answers (one prompt in five answered otherwise beside others than alone), which the content check
            would count as corrupted.
        redis_disk_mib: the size of the embedded Redis's disk where redis_disk_full is injected.
        recovery_timeout_s: give up measuring a recovery after this long (reported as never).
        ready_timeout_s: how long the service may take to start.
    """

    faults: tuple[str, ...] = FAULTS
    rate_per_s: float = 2.0
    max_tokens: int = 48
    window_s: float = 40.0
    warmup_s: float = 5.0
    stop_s: float = 10.0
    burst_factor: int = 10
    num_workers: int = 2
    max_concurrent_requests: int = 16
    num_cpus: int = 8
    dtype: str = "float32"
    redis_disk_mib: int = 64
    recovery_timeout_s: float = 60.0
    ready_timeout_s: float = 900.0

    def __post_init__(self) -> None:
        unknown = [name for name in self.faults if name not in FAULTS]
        if unknown:
            raise ValueError(f"unknown faults {unknown}; choose from {list(FAULTS)}")
        if self.rate_per_s <= 0 or self.window_s <= 0 or self.max_tokens < 1 or self.burst_factor < 1:
            raise ValueError("rate_per_s, window_s, max_tokens and burst_factor must be positive")
        if self.num_workers < 2 and "kill_worker" in self.faults:
            raise ValueError("kill_worker needs num_workers >= 2 (one to kill, one to fail over to)")


def quick_config(**overrides) -> ChaosBenchConfig:
    """About 5 minutes after the service is up."""
    return replace(ChaosBenchConfig(rate_per_s=1.0, max_tokens=24, window_s=25.0), **overrides)


def inject(fault: str, service: ServiceUnderTest, burst_results: list) -> threading.Thread | None:
    """Start one fault (returns at once; stop_worker resumes its worker from a timer, burst runs in the
    thread it returns)."""
    config = service.config
    if fault == "kill_worker":
        os.kill(service.worker_pids()[0], signal.SIGKILL)
    elif fault == "kill_redis":
        os.kill(service.redis_pid(), signal.SIGKILL)
    elif fault == "kill_controller":
        os.kill(service.controller_pid(), signal.SIGKILL)
    elif fault == "kill_router":
        os.kill(service.router_pid(), signal.SIGKILL)
    elif fault.startswith("stop_"):
        pid = {"stop_worker": lambda: service.worker_pids()[0], "stop_redis": service.redis_pid,
               "stop_controller": service.controller_pid}[fault]()
        os.kill(pid, signal.SIGSTOP)
        timer = threading.Timer(config.stop_s, _resume, args=(pid,))
        timer.daemon = True
        timer.start()
    elif fault == "redis_disk_full":
        if service.redis_disk is None:
            raise ValueError("redis_disk_full needs the embedded Redis on a SmallDisk (see bench_service)")
        service.redis_disk.fill()
        timer = threading.Timer(config.stop_s, service.redis_disk.free)  # from now: the fault's length is stop_s
        timer.daemon = True
        timer.start()
        if not service.wait_until_redis_cannot_write():  # so that recovery is not probed before the fault is felt
            print("chaos: redis_disk_full: Redis has not failed an append within 5 s; recovery is probed anyway",
                  flush=True)
    elif fault == "burst":
        thread = threading.Thread(target=_burst, args=(service, burst_results), daemon=True)
        thread.start()
        return thread
    return None


def _resume(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass  # the controller declared it dead and killed it meanwhile


def _burst_prompts(config: ChaosBenchConfig) -> dict[str, str]:
    """The burst's requests: id -> prompt."""
    count = config.burst_factor * config.max_concurrent_requests
    return {f"burst-{i}": PROMPTS[i % len(PROMPTS)] for i in range(count)}


def _burst(service: ServiceUnderTest, out: list) -> None:
    config = service.config
    requests = tuple(LoadRequest(request_id, 0.0, prompt, 0, config.max_tokens, config.max_tokens)
                     for request_id, prompt in _burst_prompts(config).items())
    count = len(requests)
    plan = LoadPlan(service.running.base_url, service.running.config.model_id, count, requests, endpoint="chat")
    start_unix_s, start_s = time.time(), time.monotonic()
    for result in asyncio.run(drive(plan, start_s=start_s)):
        out.append((start_unix_s, result))


def load_plan(config: ChaosBenchConfig, base_url: str, model_id: str) -> LoadPlan:
    """Chats at a fixed rate from t=0 to the end of the last window."""
    duration_s = config.warmup_s + config.window_s * (1 + len(config.faults))
    count = int(duration_s * config.rate_per_s)
    requests = tuple(LoadRequest(f"load-{i}", i / config.rate_per_s, PROMPTS[i % len(PROMPTS)], 0,
                                 config.max_tokens, config.max_tokens) for i in range(count))
    return LoadPlan(base_url, model_id, 64, requests, endpoint="chat")


def run(config: ChaosBenchConfig, model_name: str = "smollm2-135m-instruct", model_cache_dir: Path | None = None,
        json_path: Path | None = None) -> dict:
    """Start the service, run the load and the faults, print the table, write JSON."""
    left_out = {}
    with tempfile.TemporaryDirectory(prefix="s3serve-chaos-") as work:
        disk = None
        if "redis_disk_full" in config.faults:
            disk = SmallDisk(redis_data_dir(Path(work)), config.redis_disk_mib)
            try:
                disk.mount()
            except SmallDiskUnavailable as error:
                print(f"chaos: redis_disk_full left out: {error}", flush=True)
                left_out["redis_disk_full"] = str(error)
                config = replace(config, faults=tuple(name for name in config.faults if name != "redis_disk_full"))
                disk = None
        try:
            with bench_service(config, model_name, model_cache_dir, Path(work), "chaos") as running:
                result = _run_faults(config, running, Path(work), disk)
        finally:
            if disk is not None:
                disk.unmount()
    result["faults_left_out"] = left_out
    result["environment"] = environment()
    _print(result)
    write_json(json_path, result)
    return result


def reference_digests(config: ChaosBenchConfig, base_url: str, model_id: str) -> dict[str, str]:
    """Each prompt's answer, alone on the fault-free service: prompt -> `output_digest`."""
    requests = tuple(LoadRequest(f"reference-{i}", 0.0, prompt, 0, config.max_tokens, config.max_tokens)
                     for i, prompt in enumerate(PROMPTS))
    results = asyncio.run(drive(LoadPlan(base_url, model_id, 1, requests, endpoint="chat")))
    broken = [r for r in results if not r.is_ok or r.output_digest is None]
    if broken:
        raise RuntimeError(f"the fault-free reference answers failed: {broken[0].status_code} {broken[0].error}")
    return {request.prompt: result.output_digest for request, result in zip(requests, results)}


def _run_faults(config: ChaosBenchConfig, running, work_dir: Path, redis_disk: SmallDisk | None) -> dict:
    plan_path, results_path = work_dir / "plan.json", work_dir / "results.json"
    reference_by_prompt = reference_digests(config, running.base_url, running.config.model_id)
    plan = load_plan(config, running.base_url, running.config.model_id)
    write_plan(plan_path, plan)
    load = subprocess.Popen([sys.executable, "-m", "benchmarks.http_load", "--plan", str(plan_path),
                             "--out", str(results_path), "--desc", "chaos load"])
    service = ServiceUnderTest(running, config, load.pid, redis_disk)
    launched_s = time.monotonic()
    memory_start_mib = service.memory_mib()
    burst_results: list = []
    threads: list[threading.Thread] = []
    windows: list[dict] = []  # name, start_unix_s, recovery_s, memory_before_mib, memory_after_mib
    for index, name in enumerate(("none", *config.faults)):
        _sleep_until(launched_s + config.warmup_s + index * config.window_s)
        memory_mib = service.memory_mib()
        if windows:
            windows[-1]["memory_after_mib"] = memory_mib
        print(f"chaos: {name}", flush=True)
        start_unix_s, start_s = time.time(), time.monotonic()
        recovery_s = 0.0
        if name != "none":
            thread = inject(name, service, burst_results)
            if thread is not None:
                threads.append(thread)
            recovery_s = service.recovery_s(start_s)
            print(f"chaos: {name}: " + (f"recovered in {recovery_s:.1f} s" if recovery_s is not None
                                         else f"not recovered within {config.recovery_timeout_s:.0f} s"), flush=True)
        windows.append({"name": name, "start_unix_s": start_unix_s, "recovery_s": recovery_s,
                        "memory_before_mib": memory_mib, "memory_after_mib": memory_mib})
    _sleep_until(launched_s + config.warmup_s + (1 + len(config.faults)) * config.window_s)
    windows[-1]["memory_after_mib"] = memory_end_mib = service.memory_mib()
    for thread in threads:
        thread.join(timeout=600)
        if thread.is_alive():
            raise RuntimeError("the burst did not finish within 10 minutes")
    if load.wait(timeout=600) != 0:
        raise RuntimeError(f"the load generator exited with {load.returncode} (its error is printed above)")
    start_unix_s = read_start_unix_s(results_path)
    results = read_results(results_path)
    results += [replace(r, sent_s=burst_start_unix_s + r.sent_s - start_unix_s)
                for burst_start_unix_s, r in burst_results]
    events = [FaultEvent(**w) for w in windows]
    prompts = {r.request_id: r.prompt for r in plan.requests}
    prompts.update(_burst_prompts(config))
    references = {request_id: reference_by_prompt[prompt] for request_id, prompt in prompts.items()}
    rows = fault_rows(results, start_unix_s, events, config.max_tokens, references)
    return {"benchmark": "chaos", "config": asdict(config), "faults": rows,
            "totals": totals(rows, memory_start_mib, memory_end_mib), "targets": TARGETS}


def _sleep_until(monotonic_s: float) -> None:
    time.sleep(max(0.0, monotonic_s - time.monotonic()))


def _print(result: dict) -> None:
    headers = ["fault", "sent", "whole", "refused", "failed", "statuses", "dup", "trunc", "corrupt", "lost",
               "recovery_s", "mem_MiB_before", "mem_MiB_after"]
    rows = [[r["name"], r["sent"], r["completed"], r["refused"], r["failed"],
             " ".join(f"{k}:{v}" for k, v in sorted(r["failed_by_status"].items())) or "-", r["duplicated"],
             r["truncated"], r["corrupted"], r["lost"], "never" if r["recovery_s"] is None else float(r["recovery_s"]),
             float(r["memory_before_mib"]), float(r["memory_after_mib"])] for r in result["faults"]]
    print(format_table(headers, rows))
    t = result["totals"]
    growth = "n/a" if t["memory_growth"] is None else f"{t['memory_growth'] * 100:+.1f}%"
    recovery = "never" if t["max_recovery_s"] is None else f"{t['max_recovery_s']:.1f} s"
    print(f"\ntotals: {t['sent']} sent, {t['completed']} whole, {t['refused']} refused with Retry-After, "
          f"{t['lost']} lost ({t['failed']} failed, {t['truncated']} truncated, {t['duplicated']} duplicated, "
          f"{t['corrupted']} corrupted: whole but not the fault-free text); "
          f"slowest recovery {recovery}; memory {t['memory_start_mib']:.0f} -> {t['memory_end_mib']:.0f} MiB "
          f"({growth})")
    print("targets: 0 lost, 0 duplicated, 0 truncated, 0 corrupted, recovery <= 15 s for every fault, "
          "memory growth <= 10%")
