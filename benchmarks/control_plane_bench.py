"""`s3serve bench control-plane`: how fast the controller places, and what the service adds to each request.

1. Placement. One `ControlPlane` (the controller actor's logic, unchanged) over the
   real embedded redis-server and N simulated workers (`benchmarks.simulated_workers`:
   no model; each holds a request's blocks for `step_s` per output token, then the
   request finishes). `concurrency` simulated routers place requests back to back;
   each placed request generates and finishes in the background, so placements,
   releases and the controller's own loop (polling every worker, every
   stats_interval_s) all compete, as in a real controller. Reported per worker
   count: placements/s, and p50/p99 of the time inside `place()` (the first
   `warmup` placements are left out). The simulated routers share the controller's
   event loop, so the numbers are a lower bound of what the controller sustains alone.
   Place latency leaves out time a request waited for KV room (the `queued_s` the
   controller reports, as the service's overhead header does); waits are counted.
   Two runs per pool size: capacity (placements/s with `concurrency` routers placing back
   to back) and latency under load (Poisson arrivals at `offered_per_s`, or at 90% of the
   capacity just measured when that is lower: p50/p99 of the time inside `place()`,
   queueing for the controller's loop included). A placement that raises is counted under
   `failed` by error type, not retried.
2. Overhead. The real service (`s3serve serve` in this process: Ray, embedded Redis,
   one SmolLM2 worker), then `x-s3-overhead-ms` (router + predictor + placement,
   without queueing for KV room) of sequential requests (idle) and of a burst of
   `burst_size` concurrent ones (`num_bursts` of them, one after another).
"""

import asyncio
import collections
import gc
import itertools
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.report import environment, format_table, percentile, write_json
from benchmarks.simulated_workers import SimulatedWorkerBackend
from cluster.config import service_default
from workers.actors.ports import free_port

OVERHEAD_HEADER = "x-s3-overhead-ms"
OFFERED_SHARE_OF_CAPACITY = 0.9  # the latency run offers at most this share of the measured capacity


@dataclass(frozen=True, slots=True)
class ControlPlaneBenchConfig:
    """What `bench control-plane` runs.

    Attributes:
        worker_counts: simulated pool sizes.
        num_placements: placements per pool size (warm-up included).
        warmup: first placements left out of the latency percentiles.
        concurrency: simulated routers placing back to back (the capacity run).
        offered_per_s: arrival rate of the latency run (Poisson, open loop).
        step_s: simulated time per generated token.
        blocks_per_worker: KV blocks of each simulated worker (16-token blocks; 2048 = 32k tokens, a
            GPU worker of a 7B model, so that even 16 workers place 2,000/s without waiting for room).
        stats_interval_s: the controller loop's polling interval.
        run_service: also measure the real service's overhead.
        idle_requests, burst_size, num_bursts: the overhead measurement (bursts one after another;
            the percentiles pool every request of every burst).
        ready_timeout_s: how long the real service may take to start.
    """

    worker_counts: tuple[int, ...] = (16, 256, 1024)
    num_placements: int = 5000
    warmup: int = 500
    concurrency: int = 8
    offered_per_s: float = 2000.0
    step_s: float = 0.001
    blocks_per_worker: int = 2048
    stats_interval_s: float = service_default("stats_interval_s")
    run_service: bool = True
    idle_requests: int = 40
    burst_size: int = 32
    num_bursts: int = 5
    ready_timeout_s: float = 900.0


def _percentile_ms(values: list[float], q: float) -> float | None:
    """`percentile` of seconds, in milliseconds."""
    value = percentile(values, q)
    return None if value is None else value * 1000.0


async def measure_placements(redis_url: str, num_workers: int, config: ControlPlaneBenchConfig, progress) -> dict:
    """Placements/s and place latency of one ControlPlane over `num_workers` simulated workers."""
    from cluster.config import ServiceConfig
    from cluster.control.control_plane import ControlPlane
    from cluster.control.messages import RequestOutcome
    from cluster.control.redis_server import connect_async
    from cluster.control.store import ControllerStore

    client = connect_async(redis_url)
    await client.flushdb()
    sim = SimulatedWorkerBackend(num_total_blocks=config.blocks_per_worker, block_size=16, step_s=config.step_s)
    service = ServiceConfig(num_workers=num_workers, block_size=16, policy="s3", max_model_len=1024,
                            max_pending_placements=100_000, placement_timeout_s=600.0,
                            stats_interval_s=config.stats_interval_s, retrain=False)
    plane = ControlPlane(service, ControllerStore(client), sim)
    await plane.start()
    while len(plane.pool.ready_ids()) < num_workers:
        await asyncio.sleep(0.01)
    gc.freeze()  # as the controller actor does after starting
    loop_task = asyncio.get_running_loop().create_task(plane.run())
    rng = random.Random(num_workers)
    latencies: list[float] = []
    background: set[asyncio.Task] = set()
    counter = itertools.count()
    num_queued = [0, 0]  # placements that waited for KV room: capacity run, latency run
    failed: list[str] = []  # placements that raised (e.g. Redis overloaded), by error type
    placed_at_s = [0.0]  # when the latest placement returned

    async def place_one(request_id: str, run: int):
        """Draw a request and place it, recording its place latency; (placement, output tokens), or None if
        placing raised (counted in `failed`; the run goes on). `run`: 0 capacity, 1 latency."""
        num_prompt, num_output = rng.randint(16, 256), rng.randint(16, 256)
        start_s = time.perf_counter()
        try:
            placement = await plane.place(request_id, num_prompt, 1024 - num_prompt, num_output)
        except Exception as error:  # noqa: BLE001 - counted and reported; the run goes on
            failed.append(type(error).__name__)
            return None
        placed_at_s[0] = time.perf_counter()
        latencies.append(placed_at_s[0] - start_s - placement.queued_s)
        num_queued[run] += placement.queued_s > 0
        return placement, num_output

    async def serve(request_id: str, placement, num_output: int) -> None:
        await sim.generate(placement.worker_id, request_id, placement.num_reserved_blocks, num_output)
        await plane.finish(request_id, RequestOutcome("", 40, 900, 0.0, num_output, num_output, "length"))

    async def simulated_router() -> None:
        while (index := next(counter)) < config.num_placements:
            placed = await place_one(f"r{index}", 0)
            if placed is None:
                continue
            task = asyncio.get_running_loop().create_task(serve(f"r{index}", *placed))
            background.add(task)
            task.add_done_callback(background.discard)
            if index % 1000 == 0:
                progress(f"  {num_workers} workers: {index} placements")

    start_s = time.perf_counter()
    await asyncio.gather(*(simulated_router() for _ in range(config.concurrency)))
    elapsed_s = time.perf_counter() - start_s
    capacity = latencies[config.warmup:]
    placed_per_s = len(latencies) / elapsed_s  # failed placements do not count

    # Latency under load: arrivals at a fixed rate, each placement on its own (open loop), below the
    # capacity just measured (with few workers that is bound by KV room: above it the queue only grows).
    offered_per_s = min(config.offered_per_s, OFFERED_SHARE_OF_CAPACITY * placed_per_s)
    latencies.clear()
    arrivals = random.Random(num_workers + 1)
    offered_start_s = time.perf_counter()
    placing: set[asyncio.Task] = set()
    placed_at_s[0] = offered_start_s

    async def arrive(index: int) -> None:
        placed = await place_one(f"o{index}", 1)
        if placed is not None:
            await serve(f"o{index}", *placed)

    next_s = offered_start_s
    for index in range(config.num_placements):
        next_s += arrivals.expovariate(offered_per_s)
        delay = next_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        task = asyncio.get_running_loop().create_task(arrive(index))
        placing.add(task)
        task.add_done_callback(placing.discard)
    await asyncio.gather(*list(placing))
    offered_elapsed_s = placed_at_s[0] - offered_start_s
    await asyncio.gather(*list(background))
    loop_task.cancel()
    leftover = len(plane.ledger)
    await client.aclose()
    num_offered_placed = len(latencies)
    measured = latencies[config.warmup:]
    return {
        "num_workers": num_workers,
        "placements": config.num_placements,
        "placements_per_s": placed_per_s,
        "capacity_place_p50_ms": _percentile_ms(capacity, 0.5),
        "capacity_place_p99_ms": _percentile_ms(capacity, 0.99),
        "offered_per_s": offered_per_s,
        "achieved_per_s": num_offered_placed / offered_elapsed_s,
        "place_p50_ms": _percentile_ms(measured, 0.5),
        "place_p99_ms": _percentile_ms(measured, 0.99),
        "place_max_ms": _percentile_ms(measured, 1.0),
        "queued_for_room": {"capacity": num_queued[0], "latency": num_queued[1]},
        "ledger_left_after_finish": leftover,
        "failed": dict(collections.Counter(failed)),
    }


def measure_overhead(config: ControlPlaneBenchConfig, model_name: str, model_cache_dir: Path | None,
                     progress) -> dict:
    """x-s3-overhead-ms of the real service: sequential requests, then a concurrent burst."""
    import httpx
    import ray

    from cluster.config import ServiceConfig
    from cluster.local_ray import start_local_ray
    from cluster.service import start_service, stop_service

    with tempfile.TemporaryDirectory(prefix="s3serve-ctl-bench-") as data_dir:
        service = ServiceConfig(port=free_port(), model=model_name,
                                model_cache_dir=str(model_cache_dir) if model_cache_dir else None,
                                data_dir=data_dir, num_workers=1, retrain=False, default_max_tokens=4)
        start_local_ray(None, log_to_driver=False)
        progress("  starting the service (one SmolLM2 worker)")
        running = start_service(service, config.ready_timeout_s, progress=lambda _msg: None)
        try:
            url = f"{running.base_url}/v1/completions"
            body = {"model": service.model_id, "prompt": "Say hello.", "max_tokens": 2}
            with httpx.Client(timeout=120.0) as client:
                for _ in range(5):  # warm-up: first calls build handles and load the predictor
                    client.post(url, json=body).raise_for_status()
                idle = []
                for _ in range(config.idle_requests):
                    response = client.post(url, json=body)
                    response.raise_for_status()
                    idle.append(float(response.headers[OVERHEAD_HEADER]))

            async def burst() -> list[float]:
                async with httpx.AsyncClient(timeout=300.0) as client:
                    responses = await asyncio.gather(*(client.post(url, json=body)
                                                       for _ in range(config.burst_size)))
                return [float(r.headers[OVERHEAD_HEADER]) for r in responses if r.status_code == 200]

            bursty = []
            for _ in range(config.num_bursts):
                bursty += asyncio.run(burst())
        finally:
            stop_service(running)
            ray.shutdown()
    return {"idle_p50_ms": statistics.median(idle), "idle_p99_ms": _percentile_ms([v / 1000 for v in idle], 0.99),
            "burst_p50_ms": statistics.median(bursty) if bursty else None,
            "burst_p99_ms": _percentile_ms([v / 1000 for v in bursty], 0.99), "burst_answered": len(bursty),
            "burst_size": config.burst_size, "num_bursts": config.num_bursts, "idle_requests": config.idle_requests}


def run(config: ControlPlaneBenchConfig, model_name: str = "smollm2-135m-instruct",
        model_cache_dir: Path | None = None, json_path: Path | None = None, progress=print) -> dict:
    """Placement at every worker count, then the service's overhead; print tables, write JSON."""
    from cluster.control.redis_server import EmbeddedRedis

    placement = {}
    with tempfile.TemporaryDirectory(prefix="s3serve-ctl-redis-") as redis_dir, EmbeddedRedis(Path(redis_dir)) as redis:
        for num_workers in config.worker_counts:
            progress(f"placement with {num_workers} simulated workers, real Redis")
            placement[str(num_workers)] = asyncio.run(measure_placements(redis.url, num_workers, config, progress))
    print(format_table(["workers", "placements/s (capacity)", "offered/s", "achieved/s", "place_p50_ms",
                        "place_p99_ms", "place_max_ms", "waited_for_room", "failed"],
                       [[p["num_workers"], p["placements_per_s"], p["offered_per_s"], p["achieved_per_s"],
                         p["place_p50_ms"], p["place_p99_ms"], p["place_max_ms"], p["queued_for_room"]["latency"],
                         sum(p["failed"].values())]
                        for p in placement.values()]))
    print(f"capacity: {config.concurrency} simulated routers placing back to back; latency: Poisson arrivals at "
          f"offered/s (--offered, at most 90% of capacity); real Redis, simulated workers (no model)")
    result = {"benchmark": "control-plane", "placement": placement, "config": {
        "num_placements": config.num_placements, "concurrency": config.concurrency, "step_s": config.step_s,
        "offered_per_s": config.offered_per_s,
        "blocks_per_worker": config.blocks_per_worker, "stats_interval_s": config.stats_interval_s}}
    if config.run_service:
        progress("overhead of the real service")
        overhead = measure_overhead(config, model_name, model_cache_dir, progress)
        print(format_table(["overhead", "p50_ms", "p99_ms", "requests"],
                           [["idle (sequential)", overhead["idle_p50_ms"], overhead["idle_p99_ms"],
                             overhead["idle_requests"]],
                            [f"{overhead['num_bursts']} bursts of {overhead['burst_size']}", overhead["burst_p50_ms"], overhead["burst_p99_ms"],
                             overhead["burst_answered"]]]))
        result["overhead"] = overhead
    result["environment"] = environment()
    write_json(json_path, result)
    return result
