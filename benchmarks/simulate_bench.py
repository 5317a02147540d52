"""`s3serve bench simulate`: the policies at 8 to 1,024 workers, by discrete-event simulation.

A SIMULATION, not a measurement: the workers' schedulers, the policies and the controller's
placement are the service's own code (`benchmarks.cluster_sim`), but time comes from a step
model. For GPU kinds that model is a roofline over datasheet numbers with assumed efficiencies
(`benchmarks.step_time.GPU_KINDS`); no GPU measured it. What was measured is how well the
simulator tracks the real engine on this CPU (`benchmarks.sim_calibration`): that error is
printed first, and `kind="cpu"` simulates the cluster with the CPU-calibrated model itself.

Two workloads: `trace` replays a serving trace's lengths (default Azure conv: long prompts,
mean 1,155 context and 211 generated tokens); `paper` is the S3 paper's kind of workload,
short instructions with text-davinci-003's answers (`benchmarks.answer_lengths`, mean about
86 + 87 tokens), where reserving the worst case wastes the most.

By default every request arrives at t=0, so two rates are reported: `tokens_per_s` over the
whole run, and `steady_tokens_per_s` until 90% of the requests have finished. The first
includes the drain, when a few of the longest answers decode alone whatever the policy; the
second is the cluster's capacity. (It does not end at the last request's start: a policy that
admits everything at once would then be judged on its first prefills alone.) With
`arrival_rate_per_worker`, requests arrive online instead (Poisson, seeded), and the latency
columns (mean, p99, TTFT) say how each routing (`cluster.control.routing`) serves them.
"""

import itertools
import random
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from tqdm import tqdm

from benchmarks.answer_lengths import DEFAULT_ANSWERS, read_answer_rows
from benchmarks.cluster_sim import SIMPLIFICATIONS, ClusterSimulation
from benchmarks.noisy_oracle import NoisyOraclePredictor
from benchmarks.prompt_pool import DEFAULT_PROMPTS
from benchmarks.report import environment, format_table, percentile, write_json
from benchmarks.sim_ratios import policy_ratios, ratios_against
from cluster.config import service_default
from cluster.control.placement import DEFAULT_LATE_BINDING
from benchmarks.sim_worker import SimConfig, SimRequest
from benchmarks.step_time import RooflineStepModel, gpu_kind, shape_cost
from benchmarks.traces import read_trace
from cluster.control.rebalance import check_min_gap
from cluster.control.routing import DEFAULT_ROUTING, check_routing
from predictor_service.length_predictor import LengthQuery
from workers.scheduling.policies import POLICY_NAMES, make_policy, overcommit_options

STATEMENT = ("SIMULATION: the service's scheduler, policies and placement code driven by a modelled clock; "
             "GPU step times are a datasheet roofline with assumed efficiencies, not measured on a GPU")
DEFAULT_TRACE = Path("../shared/data/traces/AzureLLMInferenceTrace_conv.csv")
DEFAULT_POLICIES = ("max_reserve", "paged_greedy", "s3", "s3_peak", "sglang_ratio")
CPU_KIND = "cpu"
WORKLOADS = ("trace", "paper")
BINDINGS = ("late", "arrival")  # the service's late_binding on, off
# (worker counts, requests per worker) for the paper workload: its answers are short, so each worker
# needs several times max_num_seqs requests before the steady rate means anything
PAPER_SIZES = {False: ((8, 64), 1000), True: ((8,), 600)}


@dataclass(frozen=True, slots=True)
class SimulateBenchConfig:
    """What `bench simulate` runs.

    Attributes:
        workload: "trace" (the rows of `trace_path`) or "paper" (the answers of `answers_path`).
        kind: a GPU kind of `benchmarks.step_time.GPU_KINDS`, or "cpu" (the step model calibrated here).
        model_shape: a `workers.engine.model_shapes` name (ignored for "cpu": SmolLM2-135M, as calibrated).
        worker_counts: cluster sizes.
        requests_per_worker: trace rows replayed per worker (rows are reused from the start when the
            trace runs out); every request arrives at t=0, so tokens/s is the cluster's capacity.
        max_len: longest sequence; max_tokens of a request is max_len - prompt.
        max_prompt_tokens: prompts are capped to this.
        sigma: log-normal error of the noisy-oracle predictor (upper bound at the 90% quantile).
        gpu_memory_fraction: of device memory for weights plus KV (the KV budget is the rest).
        calibrate: run the real CPU engine first and print the simulator's error against it.
        calibration_device: where that real engine runs: "cpu" (SmolLM2-135M's weights) or a CUDA device (a
            random bf16 model of `model_shape`, whose steps also check the roofline of `kind`).
        rebalance_min_gap: the controller's `rebalance_min_gap` (0: no load rebalancing between workers).
        overcommit_step: s3_peak's budget stretch per refusing step (None: its default; 0: none).
        routings: the controller's routings to compare (`ServiceConfig.routing`), each with every policy.
        bindings: "late" (the service's `late_binding`: requests wait in the controller's queue until a worker can
            start them) and/or "arrival" (each goes to a worker with KV room on arrival), each with every routing.
        arrival_rate_per_worker: requests per second per worker, Poisson (seeded); None: all at t=0.
    """

    trace_path: Path = DEFAULT_TRACE
    workload: str = "trace"
    answers_path: Path = DEFAULT_ANSWERS
    prompts_path: Path = DEFAULT_PROMPTS
    kind: str = "a100-80gb"
    model_shape: str = "llama-7b"
    worker_counts: tuple[int, ...] = (8, 64, 256, 1024)
    requests_per_worker: int = 200
    max_len: int = 2048
    max_prompt_tokens: int = 1024
    sigma: float = 0.3
    policies: tuple[str, ...] = DEFAULT_POLICIES
    gpu_memory_fraction: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_pending: int = 128
    block_size: int = service_default("block_size")
    seed: int = 0
    calibrate: bool = True
    calibration_requests: int = 24
    calibration_max_len: int = 512
    calibration_device: str = "cpu"
    rebalance_min_gap: int = service_default("rebalance_min_gap")
    overcommit_step: float | None = service_default("overcommit_step")
    routings: tuple[str, ...] = (DEFAULT_ROUTING,)
    bindings: tuple[str, ...] = ("late" if DEFAULT_LATE_BINDING else "arrival",)  # the service's
    arrival_rate_per_worker: float | None = None


def quick_config(**overrides) -> SimulateBenchConfig:
    return SimulateBenchConfig(**{"worker_counts": (8, 64), "requests_per_worker": 150,
                                  "calibration_requests": 16, **overrides})


def default_config(workload: str = "trace", quick: bool = False) -> SimulateBenchConfig:
    """The sizes `bench simulate` runs a workload at, before the command line's overrides (`run` checks the name)."""
    base = replace(quick_config() if quick else SimulateBenchConfig(), workload=workload)
    if workload == "paper":
        worker_counts, requests_per_worker = PAPER_SIZES[quick]
        return replace(base, worker_counts=worker_counts, requests_per_worker=requests_per_worker)
    return base


def build_sim_requests(rows, count: int, max_len: int, max_prompt_tokens: int, sigma: float,
                       seed: int) -> list[SimRequest]:
    """`count` requests from the trace rows, all at t=0, with noisy-oracle upper bounds and points.

    The rows are reused when `count` exceeds them: the first pass in the file's order, each later
    pass in a fresh seeded order. Repeating one order would repeat one pattern of lengths that a
    deterministic placement can lock onto (the same long answers landing on the same workers).
    """
    if not rows:
        raise ValueError("the trace has no rows")
    if max_prompt_tokens >= max_len:
        raise ValueError(f"max_prompt_tokens ({max_prompt_tokens}) must be below max_len ({max_len})")
    shapes = []
    for index, row in zip(range(count), _passes(rows, random.Random(seed))):
        prompt = max(1, min(row.context_tokens, max_prompt_tokens))
        shapes.append((f"r{index}", prompt, max(1, min(row.generated_tokens, max_len - prompt))))
    oracle = NoisyOraclePredictor({rid: out for rid, _, out in shapes}, sigma=sigma, max_len=max_len, seed=seed)
    bounds = oracle.predict([LengthQuery(rid, (), max_len - prompt) for rid, prompt, _ in shapes])
    return [SimRequest(rid, 0.0, prompt, out, max_len - prompt, bound.upper_bound_tokens, bound.point_tokens)
            for (rid, prompt, out), bound in zip(shapes, bounds)]


def poisson_arrivals(requests: list[SimRequest], rate_per_s: float, seed: int) -> list[SimRequest]:
    """The requests in their order, arriving as a seeded Poisson process of `rate_per_s`."""
    rng = random.Random(seed)
    arrival_s, timed = 0.0, []
    for request in requests:
        arrival_s += rng.expovariate(rate_per_s)
        timed.append(replace(request, arrival_s=arrival_s))
    return timed


def _passes(rows: list, rng: random.Random) -> Iterator:
    """The rows in their order, then again and again, each time shuffled by `rng`."""
    yield from rows
    order = list(rows)
    while True:
        rng.shuffle(order)
        yield from order


def _run_calibration(config: SimulateBenchConfig, rows, model_name: str, model_cache_dir: Path | None):
    """The real engine on this machine against the simulator (`benchmarks.sim_calibration.Calibration`)."""
    from benchmarks.sim_calibration import calibrate_on_trace

    return calibrate_on_trace(rows[:config.calibration_requests], model_name, model_cache_dir,
                              device=config.calibration_device, model_shape=config.model_shape, kind=config.kind,
                              max_len=config.calibration_max_len, block_size=config.block_size,
                              sigma=config.sigma, seed=config.seed, prompts_path=config.prompts_path)


def _cluster_model(config: SimulateBenchConfig, calibration):
    """(step model, KV blocks per worker, description of the budget)."""
    if config.kind == CPU_KIND:
        model = calibration.model
        kv_tokens = 4 * config.max_len  # max_reserve fits 4 sequences, as in the calibration
        return model, kv_tokens // config.block_size, (
            f"KV for 4 x {config.max_len} tokens per worker (max_reserve fits 4, as in the calibration; contexts "
            f"beyond its {config.calibration_max_len} tokens extrapolate the linear model)")
    model = RooflineStepModel(gpu_kind(config.kind), shape_cost(config.model_shape))
    gpu = model.gpu
    kv_bytes = gpu.memory_bytes * config.gpu_memory_fraction - model.cost.weight_bytes
    num_blocks = int(kv_bytes // (model.kv_bytes_per_token * config.block_size))
    if num_blocks * config.block_size < config.max_len:
        raise ValueError(f"{config.model_shape} leaves {max(0, kv_bytes) / 1e9:.1f} GB of KV on {config.kind}: "
                         f"not one {config.max_len}-token sequence")
    return model, num_blocks, (f"{kv_bytes / 1e9:.1f} GB KV per worker = {num_blocks * config.block_size} tokens "
                               f"(max_reserve fits {num_blocks * config.block_size // config.max_len} sequences)")


def run(config: SimulateBenchConfig, model_name: str = "smollm2-135m-instruct", model_cache_dir: Path | None = None,
        json_path: Path | None = None, plot_path: Path | None = None) -> dict:
    unknown = [p for p in config.policies if p not in POLICY_NAMES]
    if unknown:
        raise ValueError(f"unknown policies {unknown}; choose from {', '.join(POLICY_NAMES)}")
    if config.workload not in WORKLOADS:
        raise ValueError(f"unknown workload {config.workload!r}; choose from {', '.join(WORKLOADS)}")
    if any(n < 1 for n in config.worker_counts):
        raise ValueError(f"worker counts must be >= 1, got {config.worker_counts}")
    check_min_gap(config.rebalance_min_gap, "--rebalance-min-gap")
    for routing in config.routings:
        check_routing(routing)
    if not config.bindings or any(b not in BINDINGS for b in config.bindings):
        raise ValueError(f"bindings must be among {', '.join(BINDINGS)}, got {config.bindings}")
    if config.arrival_rate_per_worker is not None and config.arrival_rate_per_worker <= 0:
        raise ValueError(f"--arrival-rate must be > 0, got {config.arrival_rate_per_worker}")
    if config.kind != CPU_KIND:
        gpu_kind(config.kind)
        shape_cost(config.model_shape)  # fail on a bad name before the calibration run
    elif not config.calibrate:
        raise ValueError("kind 'cpu' simulates with the CPU-calibrated step model: leave calibration on")
    elif config.calibration_device != "cpu":
        raise ValueError("kind 'cpu' simulates with the step model calibrated on this CPU: drop --calibration-device "
                         "or name the GPU kind it runs on")
    if config.calibration_device != "cpu" and not config.calibration_device.startswith("cuda"):
        raise ValueError(f"--calibration-device must be cpu or cuda[:N], got {config.calibration_device!r}")
    print(STATEMENT)
    rows, workload = _workload_rows(config, model_name, model_cache_dir)
    print(f"workload: {workload}")
    calibration = _run_calibration(config, rows, model_name, model_cache_dir) if config.calibrate else None
    if calibration is not None:
        print(f"step model {calibration.model.describe()}")
        print(f"fit on {calibration.fit.num_steps} steps of {calibration.calibrated_on}: mean |error| "
              f"{calibration.fit.mean_abs_pct:.1f}% per step, {calibration.fit.total_pct:+.1f}% in total time")
        print(format_table(["policy", "real tok/s", "simulated tok/s", "error %"],
                           [list(row) for row in calibration.agreement]))
        if calibration.roofline_fit is not None:
            print(f"roofline {config.kind} {config.model_shape} against every measured step: mean |error| "
                  f"{calibration.roofline_fit.mean_abs_pct:.1f}% per step, {calibration.roofline_fit.total_pct:+.1f}% "
                  f"in total time over {calibration.roofline_fit.num_steps} steps")
            print(format_table(["policy", "real tok/s", "roofline tok/s", "error %"],
                               [list(row) for row in calibration.roofline_agreement]))
    step_model, num_blocks, budget = _cluster_model(config, calibration)
    print(f"cluster: {step_model.describe()}; {budget}")
    print(f"simplified: {SIMPLIFICATIONS}")
    runs = []
    for num_workers in config.worker_counts:
        requests = build_sim_requests(rows, num_workers * config.requests_per_worker, config.max_len,
                                      config.max_prompt_tokens, config.sigma, config.seed)
        if config.arrival_rate_per_worker is not None:
            requests = poisson_arrivals(requests, config.arrival_rate_per_worker * num_workers, config.seed)
        for binding, routing, policy in itertools.product(config.bindings, config.routings, config.policies):
            sim_config = SimConfig(num_workers, num_blocks, config.block_size, config.max_num_seqs,
                                   config.max_num_batched_tokens, max_pending=config.max_pending,
                                   rebalance_min_gap=config.rebalance_min_gap, routing=routing,
                                   late_binding=binding == "late")
            with tqdm(total=len(requests), desc=f"{num_workers} workers, {policy}, {routing}, {binding} binding",
                      unit="req", mininterval=2.0) as progress:
                options = overcommit_options(policy, config.overcommit_step)
                simulation = ClusterSimulation(
                    sim_config, lambda: make_policy(policy, max_model_len=config.max_len, **options), step_model)
                result = simulation.run(requests, progress)
            runs.append({
                "policy": policy, "routing": routing, "binding": binding, "num_workers": num_workers,
                "num_requests": len(requests), "waited_at_controller": result.num_waited,
                "controller_wait_mean_s": result.controller_wait_s / max(1, result.num_waited),
                "tokens_per_s": result.tokens_per_s, "tokens_per_s_per_worker": result.tokens_per_s / num_workers,
                "steady_tokens_per_s": result.steady_tokens_per_s, "steady_s": result.steady_s,
                "makespan_s": result.makespan_s, "latency_p50_s": percentile(result.latency_s, 0.5),
                "latency_mean_s": sum(result.latency_s) / len(result.latency_s),
                "latency_p99_s": percentile(result.latency_s, 0.99), "ttft_p50_s": percentile(result.ttft_s, 0.5),
                "ttft_p99_s": percentile(result.ttft_s, 0.99),
                "migrations": result.num_migrations, "rebalances": result.num_rebalances,
                "preemptions": result.num_preemptions,
                "mispredictions": result.num_mispredictions, "refused_then_retried": result.num_refused,
                "placements_per_s": result.num_placements / result.makespan_s,
                "placement_decision_us": 1e6 * result.placement_wall_s / max(1, result.num_placement_decisions),
                "all_outputs_exact_length": result.outputs_exact, "simulation_wall_s": result.simulation_wall_s,
            })
    # the policies' ratios: one routing and binding
    first = [r for r in runs if r["routing"] == config.routings[0] and r["binding"] == config.bindings[0]]
    ratios = policy_ratios(first, config.worker_counts, "tokens_per_s")
    ratios["steady"] = policy_ratios(first, config.worker_counts, "steady_tokens_per_s")
    ratios["routing"] = ratios_against([r for r in runs if r["binding"] == config.bindings[0]], "routing", "room")
    ratios["binding"] = ratios_against(runs, "binding", "arrival")
    headers = ["workers", "policy", "routing", "binding", "tok/s", "tok/s/worker", "steady_tok/s", "lat_mean_s",
               "lat_p50_s", "lat_p99_s", "ttft_p50_s", "waited", "migrations", "rebal", "preempt", "place/s",
               "us/decision", "sim_wall_s"]
    print(format_table(headers, [[r["num_workers"], r["policy"], r["routing"], r["binding"], r["tokens_per_s"],
                                  r["tokens_per_s_per_worker"], r["steady_tokens_per_s"], r["latency_mean_s"],
                                  r["latency_p50_s"], r["latency_p99_s"], r["ttft_p50_s"],
                                  r["waited_at_controller"], r["migrations"],
                                  r["rebalances"], r["preemptions"], r["placements_per_s"],
                                  r["placement_decision_us"], r["simulation_wall_s"]] for r in runs]))
    if ratios["routing"]:
        print(format_table(["workers", "policy", "routing vs room", "tok/s", "lat_mean", "lat_p99", "ttft_p50"],
                           [[k.split("/")[0], k.split("/")[1], k.split("/")[2], *v.values()]
                            for k, v in ratios["routing"].items()]))
    if ratios["binding"]:
        print(format_table(["workers", "policy", "routing", "late/arrival tok/s", "lat_mean", "lat_p99", "ttft_p50"],
                           [[*k.split("/"), *v.values()] for k, v in ratios["binding"].items()]))
    print(format_table(["ratio", "whole run (tok/s)", "steady (steady_tok/s)"],
                       [[k, v, ratios["steady"].get(k, "n/a")] for k, v in ratios.items()
                        if not isinstance(v, dict)]))
    result = {
        "benchmark": "simulate", "simulation": True, "statement": STATEMENT, "simplifications": SIMPLIFICATIONS,
        "kind": config.kind, "model_shape": config.model_shape if config.kind != CPU_KIND else f"{model_name} (calibrated here)",
        "step_model": step_model.describe(), "kv_budget": budget,
        "workload": config.workload, "workload_description": workload,
        "arrivals": ("all at t=0" if config.arrival_rate_per_worker is None else
                     f"Poisson, {config.arrival_rate_per_worker:g} requests/s per worker (seed {config.seed})"),
        "trace": str(config.trace_path if config.workload == "trace" else config.answers_path),
        "predictor": (f"noisy oracle, log-normal sigma {config.sigma}: s3 plans by its 90% quantile, s3_peak by "
                      "its point (PlanningRule.prediction_from); sglang_ratio and the other baselines read none"),
        "config": _config_dict(config),
        "calibration": None if calibration is None else {
            "model": calibration.model.describe(), "calibrated_on": calibration.calibrated_on,
            "fit_steps": calibration.fit.num_steps, "fit_mean_abs_pct": calibration.fit.mean_abs_pct,
            "fit_total_pct": calibration.fit.total_pct,
            "device": config.calibration_device,
            "agreement": [{"policy": p, "real_tokens_per_s": real, "simulated_tokens_per_s": sim, "error_pct": err}
                          for p, real, sim, err in calibration.agreement],
            "roofline": None if calibration.roofline_fit is None else {
                "kind": config.kind, "mean_abs_pct": calibration.roofline_fit.mean_abs_pct,
                "total_pct": calibration.roofline_fit.total_pct, "num_steps": calibration.roofline_fit.num_steps,
                "agreement": [{"policy": p, "real_tokens_per_s": real, "simulated_tokens_per_s": sim,
                               "error_pct": err} for p, real, sim, err in calibration.roofline_agreement]}},
        "runs": runs, "ratios": ratios, "environment": environment(),
    }
    write_json(json_path, result)
    if plot_path is not None:
        _plot(runs, plot_path, step_model.describe().split(":")[0])
    return result


def _config_dict(config: SimulateBenchConfig) -> dict:
    return {name: (str(getattr(config, name)) if isinstance(getattr(config, name), Path) else getattr(config, name))
            for name in config.__dataclass_fields__}


def _workload_rows(config: SimulateBenchConfig, model_name: str, model_cache_dir: Path | None):
    """(rows, one line saying what they are) for the config's workload."""
    if config.workload == "trace":
        return read_trace(config.trace_path), f"trace {config.trace_path}"
    from workers.engine.models import load_tokenizer, resolve_model_dir

    rows = read_answer_rows(config.answers_path, load_tokenizer(resolve_model_dir(model_name, model_cache_dir)))
    prompt = sum(r.context_tokens for r in rows) / len(rows)
    answer = sum(r.generated_tokens for r in rows) / len(rows)
    return rows, (f"paper: {len(rows)} instructions with text-davinci-003's answers ({config.answers_path}), "
                  f"mean {prompt:.0f} prompt + {answer:.0f} answer tokens ({model_name}'s tokenizer)")


def _plot(runs: list[dict], path: Path, clock: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    for policy in dict.fromkeys(r["policy"] for r in runs):
        mine = sorted((r for r in runs if r["policy"] == policy), key=lambda r: r["num_workers"])
        workers = [r["num_workers"] for r in mine]
        axes[0].plot(workers, [r["tokens_per_s_per_worker"] for r in mine], marker="o", label=policy)
        axes[1].plot(workers, [r["latency_p99_s"] for r in mine], marker="o", label=policy)
    for axis, label in zip(axes, ("output tokens/s per worker", "p99 latency (s), all arrive at t=0")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("workers")
        axis.set_ylabel(label)
        axis.legend()
    figure.suptitle(f"Simulated cluster ({clock}; not measured)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    print(f"plot: {path}")
