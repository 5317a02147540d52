"""`s3serve bench latency`: what knowing lengths buys where requests wait, at fractions of our own capacity.

Prediction can only shorten waiting (a running sequence gets one token per step whatever is predicted), so this
bench loads one engine where a queue forms and measures who waits:

- Work: held-out pool prompts (`benchmarks.natural_workload`: none the shipped predictor trained on), each answered
  for exactly the served model's own greedy length, forced with ignore_eos: every policy does the same work (the
  tokens too, where the CPU's kernels are batch-invariant; the report says which differ). The shipped predictor
  reads each prompt's text, the shipped probe re-predicts from the engine's hidden states as the service does; the
  oracle plans by the true lengths (the labelled ceiling).
- Load: our own capacity, measured first in each setting: FCFS paging with every request at t=0, requests finished
  per second until 90% of them are (the drain of the last long answers left out). Each point offers Poisson
  arrivals (seeded) at a fraction of it; the bursty point replays the Azure conv trace's arrival times, scaled to
  `bursty_load` of it on average.
- Settings: `kv_bound` (KV for `kv_bound_slots` worst-case sequences: the S3 regime, where memory binds) and
  `default` (the service's CPU default: KV for max_num_seqs sequences of max_len, so the slots bind).
- Policies in one invocation, on equal footing (the same requests, arrival times, KV tokens, step limits, preemption
  mechanism and host budget, warm-up and number of runs): `fcfs` (paged_greedy, first come first served: vLLM's
  behaviour), `default` (the service's: s3_peak with the shipped predictor and probe), `oracle` (s3_peak on the true
  lengths, spread as s3_peak spreads any point: the ceiling of this policy with exact points), and on request
  `before` (the default with its order and preemption as they were before 2026-11-29: shortest work first only
  while KV was scarce, none for shorter work, a KV victim passed by first fit; today's aging and starvation bound),
  `no_preempt` (the default without preemption for shorter work) and `victims_passed` (the default with the
  engine's `preempted_first` off: a sequence preempted for KV waits in s3_peak's order, and smaller requests start
  before it, as before 2026-12-02).
- Rounds are interleaved: round 1 runs every setting, point and policy, then round 2 again, the policies of each
  point in reverse order on every second round (A B C, C B A), so that over each pair of rounds a machine speeding
  up or slowing down steadily favours no row (an odd number of rounds leaves the last one unbalanced). The tables
  give each value's median over the rounds and its spread ((max - min) / median); ratios are taken within a round
  and then their median is reported.
"""

import copy
import dataclasses
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from benchmarks.latency_runs import (GAUGE_SEQUENCES, WAITED_S, capacity_of, length_classes, medians_of, ratios_of,
                                     summarize)
from benchmarks.modelled_clock import CLOCKS, ModelledClock
from benchmarks.natural_workload import HELD_OUT_LABELS, Labeler, build_natural_workload, compare_outputs
from benchmarks.peers_online import unit_arrivals
from benchmarks.policy_bench import parse_predictor
from benchmarks.policy_bench_config import DEFAULT_TRACE, PolicyBenchConfig
from benchmarks.policy_replay import WARMUP_REQUESTS, PolicyRun, run_policy
from benchmarks.prompt_pool import DEFAULT_PROMPTS
from benchmarks.report import environment, format_table, write_json
from benchmarks.step_time import StepModel, fit_linear
from benchmarks.traces import read_trace
from cluster.config import service_default
from cluster.control.worker_probe import load_length_probe
from predictor_service.length_predictor import LengthQuery
from workers.engine.linear_weights import as_served, has_bf16_linear_weights, precision_label
from workers.engine.model_runner import pool_shape_for
from workers.engine.models import DEFAULT_MODEL, load_model, load_tokenizer, resolve_model_dir
from workers.engine.runtime import resolve_dtype
from workers.scheduling.engine_config import DEFAULT_MAX_QUEUE_WAIT_S, DEFAULT_SWAP_SPACE_BYTES
from workers.scheduling.policies import DEFAULT_POLICY
from workers.scheduling.preemption import PREEMPTION_MODES

SETTINGS = ("kv_bound", "default")
BURSTY = "bursty"


@dataclass(frozen=True, slots=True)
class Variant:
    """One policy row: the registry policy, what it plans by ("none", "predictor" or "true"), whether the probe
    re-predicts in the engine (`other_probe`: the config's `other_probe` instead of its `probe`), the policy's
    own options, and engine settings it sets otherwise than the service."""

    policy: str
    estimates: str
    probe: bool = False
    options: tuple[tuple[str, object], ...] = ()
    other_probe: bool = False
    engine_options: tuple[tuple[str, object], ...] = ()


VARIANTS = {
    "fcfs": Variant("paged_greedy", "none"),
    "default": Variant(DEFAULT_POLICY, "predictor", probe=True),
    "oracle": Variant(DEFAULT_POLICY, "true"),
    "before": Variant(DEFAULT_POLICY, "predictor", probe=True,
                      options=(("order_by_work", "kv_scarce"), ("shorter_work_ratio", 0.0)),
                      engine_options=(("preempted_first", False),)),
    "no_preempt": Variant(DEFAULT_POLICY, "predictor", probe=True, options=(("shorter_work_ratio", 0.0),)),
    "other_probe": Variant(DEFAULT_POLICY, "predictor", probe=True, other_probe=True),  # the default, another probe
    # the default as it was before 2026-12-02: a sequence preempted for KV waits in the policy's order, passed
    "victims_passed": Variant(DEFAULT_POLICY, "predictor", probe=True, engine_options=(("preempted_first", False),)),
}


@dataclass(frozen=True, slots=True)
class LatencyBenchConfig:
    """What `bench latency` runs.

    Attributes:
        num_requests, max_len, max_prompt_tokens: the held-out prompts (`build_natural_workload`).
        loads: Poisson points, as fractions of our measured capacity in requests/s.
        bursty_load: the bursty point's mean rate as a fraction of capacity (None: no bursty point).
        settings: "kv_bound" and/or "default" (the module docstring).
        policies: rows of `VARIANTS`; "fcfs" is what the ratios divide by.
        rounds: interleaved rounds of every setting, point and policy.
        kv_bound_slots: worst-case sequences (max_len tokens each) the kv_bound setting's KV holds.
        max_num_seqs, max_num_batched_tokens: every engine's step limits (the service's defaults).
        max_queue_wait_s: the starvation bound of every engine's queue (the service's setting).
        preemption_mode, swap_space_bytes: every policy's preemption mechanism and host budget alike.
        predictor, probe: what the default predicts with ("default": the shipped ones).
        other_probe: the probe of the `other_probe` row (a folder from `s3serve probe train`), to compare two probes
            in one invocation.
        seed: which held-out prompts, and the Poisson arrivals.
        dtype: the model's, as the service resolves it ("auto": bf16 on CPUs with bf16 instructions, fp32 over
            bf16 linear weights on AVX2-only ones).
        clock: "wall", or "modelled": every run counts time by a step-time model fitted on each setting's
            capacity run (`benchmarks.modelled_clock`), so the machine's drift between runs cannot favour a row.
    """

    num_requests: int = 300
    max_len: int = 512
    max_prompt_tokens: int = 128
    loads: tuple[float, ...] = (0.8, 0.95, 1.2)
    bursty_load: float | None = 0.95
    settings: tuple[str, ...] = SETTINGS
    policies: tuple[str, ...] = ("fcfs", "default", "oracle")
    rounds: int = 2
    kv_bound_slots: int = 8
    max_num_seqs: int = service_default("max_num_seqs")
    max_num_batched_tokens: int = service_default("max_num_batched_tokens")
    max_queue_wait_s: float = DEFAULT_MAX_QUEUE_WAIT_S
    preemption_mode: str = service_default("preemption_mode")
    swap_space_bytes: int = DEFAULT_SWAP_SPACE_BYTES
    predictor: str = "default"
    probe: str = "default"
    other_probe: str | None = None
    seed: int = 0
    dtype: str = service_default("dtype")
    clock: str = "wall"
    labels_path: Path = HELD_OUT_LABELS
    prompts_path: Path = DEFAULT_PROMPTS
    trace_path: Path = DEFAULT_TRACE

    def __post_init__(self) -> None:
        if self.num_requests < 3:
            raise ValueError(f"num_requests must be >= 3 (three length classes), got {self.num_requests}")
        if not self.loads and self.bursty_load is None:
            raise ValueError("no load point: give --loads or a bursty load")
        if any(load <= 0 for load in self.loads) or (self.bursty_load is not None and self.bursty_load <= 0):
            raise ValueError(f"loads must be positive fractions of capacity, got {list(self.loads)} and "
                             f"{self.bursty_load}")
        unknown = [s for s in self.settings if s not in SETTINGS] + [p for p in self.policies if p not in VARIANTS]
        if unknown or not self.settings or not self.policies:
            raise ValueError(f"settings must be among {', '.join(SETTINGS)} and policies among "
                             f"{', '.join(VARIANTS)}; got {list(self.settings)} and {list(self.policies)}")
        if ("other_probe" in self.policies) != (self.other_probe is not None):
            raise ValueError("the other_probe row and --other-probe go together: name the probe it runs")
        if "fcfs" not in self.policies:
            raise ValueError("policies must include fcfs: the ratios are against it")
        if self.rounds < 1 or self.kv_bound_slots < 1:
            raise ValueError(f"rounds and kv_bound_slots must be >= 1, got {self.rounds} and {self.kv_bound_slots}")
        if self.clock not in CLOCKS:
            raise ValueError(f"clock must be one of {', '.join(CLOCKS)}, got {self.clock!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}")

    @property
    def points(self) -> tuple[str, ...]:
        return tuple(f"{load:g}" for load in self.loads) + ((BURSTY,) if self.bursty_load is not None else ())


def quick_config(**overrides) -> LatencyBenchConfig:
    """The KV-bound setting at 0.95 and 1.2 of capacity, 64 requests, FCFS against the default and the oracle."""
    return LatencyBenchConfig(**{"num_requests": 64, "loads": (0.95, 1.2), "bursty_load": None,
                                 "settings": ("kv_bound",), **overrides})


def kv_tokens_of(config: LatencyBenchConfig, setting: str) -> int:
    """The KV tokens of a setting's engines: `kv_bound_slots` worst-case sequences, or (the service's CPU default)
    one max_len sequence per slot."""
    slots = config.kv_bound_slots if setting == "kv_bound" else config.max_num_seqs
    return slots * config.max_len


def policy_order(policies: tuple[str, ...], round_index: int) -> tuple[str, ...]:
    """The policies of one point in round `round_index` (from 0): as given, reversed on odd rounds, so that the
    positions of any two rows balance over each pair of rounds and a steady drift of the machine cancels."""
    return policies if round_index % 2 == 0 else policies[::-1]


def bursty_arrivals(trace_path: Path, num_requests: int) -> list[float]:
    """The trace's first arrival times, shifted to start at 0 and scaled to a mean rate of 1 request/s."""
    rows = read_trace(trace_path, num_requests + 1)
    if len(rows) < num_requests + 1:
        raise ValueError(f"{trace_path} has {len(rows)} rows; the bursty point needs {num_requests + 1}")
    times = [row.arrival_s - rows[0].arrival_s for row in rows]
    span_s = times[-1]
    if span_s <= 0:
        raise ValueError(f"{trace_path}'s first {num_requests + 1} rows arrive at one instant")
    return [t * num_requests / span_s for t in times[1:]]  # request i at t_i, the last one at num_requests s


def run(config: LatencyBenchConfig, model_name: str = DEFAULT_MODEL, model_cache_dir: Path | None = None,
        json_path: Path | None = None, labeler: Labeler | None = None) -> dict:
    """Measure each setting's capacity, then every round of every setting, point and policy; print the tables."""
    parse_predictor(config.predictor, {}, config.max_len, config.seed)  # a bad spec fails before anything loads
    model_dir = resolve_model_dir(model_name, model_cache_dir)
    tokenizer = load_tokenizer(model_dir)
    workload = build_natural_workload(tokenizer, model_name, config.num_requests, config.max_len,
                                      config.max_prompt_tokens, "offline", 1.0, config.trace_path,
                                      config.labels_path, config.prompts_path, config.seed, labeler)
    requests, info = workload.requests, workload.describe()
    true_lengths = {r.request_id: r.output_tokens for r in requests}
    classes = length_classes(true_lengths)
    model = as_served(load_model(model_dir, dtype=resolve_dtype(config.dtype, "cpu")), "cpu", config.dtype)
    precision = precision_label(model.dtype, has_bf16_linear_weights(model))
    bytes_per_token = pool_shape_for(model.config, 1, 1, model.dtype).bytes_per_block
    estimates = _estimates(config, requests, workload.texts)
    probes = {}  # other_probe -> the loaded probe
    for other in {VARIANTS[p].other_probe for p in config.policies if VARIANTS[p].probe}:
        probes[other] = load_length_probe(config.other_probe if other else config.probe, model.config.hidden_size)
        probes[other].reads_forced = True  # every forced length here is the model's own greedy one
    print(f"latency bench: {len(requests)} held-out prompts (seed {config.seed}), mean prompt "
          f"{info['mean_prompt_tokens']:.0f} tokens, answers forced to the model's own greedy lengths (mean "
          f"{info['mean_output_tokens']:.0f}, {info['hit_length_limit_fraction']:.0%} at max_tokens); model "
          f"{model_name} ({precision}); points {', '.join(config.points)} of our capacity; settings "
          f"{', '.join(config.settings)}; {config.rounds} interleaved rounds")
    units = unit_arrivals(len(requests), config.seed)
    bursty = bursty_arrivals(config.trace_path, len(requests)) if config.bursty_load is not None else None
    capacity: dict[str, dict] = {}
    step_models: dict[str, StepModel | None] = {}  # setting -> the modelled clock's step time (None: wall clock)
    for setting in config.settings:
        capacity[setting], step_models[setting] = _capacity(model, requests, config, setting, bytes_per_token)
        print(f"  {setting}: {capacity[setting]['requests_per_s']:.3f} requests/s until 90% done, "
              f"{capacity[setting]['tokens_per_s']:.0f} tokens/s in all, {kv_tokens_of(config, setting)} KV tokens"
              + (f"; time modelled, {step_models[setting].describe()}" if step_models[setting] else ""))
    plan = [(r, s, p, v) for r in range(config.rounds) for s in config.settings for p in config.points
            for v in policy_order(config.policies, r)]
    runs: list[dict] = []
    digests: dict[str, dict[str, str]] = {}
    with tqdm(total=len(plan), desc="runs (all rounds)", unit="run") as progress:
        for round_index, setting, point, name in plan:
            progress.set_postfix_str(f"round {round_index + 1} {setting} {point} {name}")
            rate = (config.bursty_load if point == BURSTY else float(point)) * capacity[setting]["requests_per_s"]
            times = bursty if point == BURSTY else units
            timed = [dataclasses.replace(r, arrival_s=t / rate) for r, t in zip(requests, times)]
            clock = ModelledClock(step_models[setting]) if step_models[setting] else None
            result = _run_variant(model, name, timed, estimates, true_lengths, config, setting, bytes_per_token,
                                  probes.get(VARIANTS[name].other_probe), clock)
            digests[f"{round_index + 1}/{setting}/{point}/{name}"] = result.digests
            runs.append({"round": round_index + 1, "setting": setting, "point": point, "rate_requests_per_s": rate,
                         **summarize(result, classes)})
            progress.update(1)
    token_check = compare_outputs(digests)
    token_check["num_requests_differing"] = len({rid for ids in token_check["differing"].values() for rid in ids})
    return _report(config, runs, capacity, info, precision, token_check, json_path)


def _capacity(model, requests, config: LatencyBenchConfig, setting: str,
              bytes_per_token: int) -> tuple[dict, StepModel | None]:
    """FCFS paging with every request at t=0: requests/s until 90% are done. With the modelled clock, its steps
    fit the step-time model and it runs again on that clock, so that the loads are fractions of modelled time."""
    at_once = [dataclasses.replace(r, arrival_s=0.0) for r in requests]

    def measure(clock: ModelledClock | None) -> PolicyRun:
        desc = f"capacity ({setting}: fcfs, all at t=0{', modelled time' if clock else ''})"
        with tqdm(total=len(requests), desc=desc, unit="req") as progress:
            return run_policy(copy.deepcopy(model), "paged_greedy", at_once, {}, _bench_config(config, setting),
                              kv_tokens_of(config, setting) * bytes_per_token, progress, clock=clock)

    result, step_model = measure(None), None
    if config.clock == "modelled":
        step_model = fit_linear(result.measured_steps, measured_on="this CPU's capacity run")
        result = measure(ModelledClock(step_model))
    return ({"requests_per_s": capacity_of(result, len(requests)),
             "tokens_per_s": result.output_tokens / result.wall_s, "kv_tokens": kv_tokens_of(config, setting),
             "clock": config.clock, "step_model": step_model.describe() if step_model else None}, step_model)


def _bench_config(config: LatencyBenchConfig, setting: str) -> PolicyBenchConfig:
    # workload "trace": outputs forced to each request's output_tokens (the labelled greedy length) with ignore_eos
    return PolicyBenchConfig(max_len=config.max_len, max_num_seqs=config.max_num_seqs,
                             max_num_batched_tokens=config.max_num_batched_tokens,
                             preemption_mode=config.preemption_mode, swap_space_bytes=config.swap_space_bytes,
                             max_queue_wait_s=config.max_queue_wait_s, workload="trace")


def _estimates(config: LatencyBenchConfig, requests, texts: dict[str, str]) -> dict[str, tuple[int, int]]:
    """(point, upper bound) per request from the configured predictor, reading each prompt's message text."""
    true_lengths = {r.request_id: r.output_tokens for r in requests}
    predictor = parse_predictor(config.predictor, true_lengths, config.max_len, config.seed,
                                lambda query: texts[query.prompt_id])
    queries = [LengthQuery(r.request_id, r.prompt_token_ids, config.max_len - len(r.prompt_token_ids))
               for r in requests]
    return {q.prompt_id: (p.point_tokens, p.upper_bound_tokens) for q, p in zip(queries, predictor.predict(queries))}


def _run_variant(model, name: str, requests, estimates, true_lengths: dict[str, int], config: LatencyBenchConfig,
                 setting: str, bytes_per_token: int, probe, clock: ModelledClock | None) -> PolicyRun:
    variant = VARIANTS[name]
    chosen = {"none": {}, "predictor": estimates,
              "true": {rid: (n, n) for rid, n in true_lengths.items()}}[variant.estimates]
    with tqdm(total=len(requests), desc=f"  {setting} {name}", unit="req", leave=False) as inner:
        return run_policy(copy.deepcopy(model), variant.policy, requests, chosen, _bench_config(config, setting),
                          kv_tokens_of(config, setting) * bytes_per_token, inner,
                          probe=probe if variant.probe else None, policy_options=dict(variant.options), label=name,
                          engine_options=dict(variant.engine_options), clock=clock)


def _report(config: LatencyBenchConfig, runs: list[dict], capacity: dict, info: dict, precision: str,
            token_check: dict, json_path: Path | None) -> dict:
    medians = medians_of(config, runs)

    def cell(values: dict, key: str, spread: bool = False) -> str:
        median, spread_share = values[key]
        if median is None:
            return "n/a"
        return f"{median:.2f} ±{spread_share:.0%}" if spread else f"{median:.2f}"

    headers = ["point", "policy", "lat_mean", "lat_p50", "lat_p99", "ttft_p50", "ttft_p99", "waited", "wait_mean",
               "wait_p99", "tok/s", "pre_kv", "pre_short", "lat_short", "lat_med", "lat_long", "step_ms"]
    for setting in config.settings:
        rows = [[point, name, cell(v, "latency_mean_s", True), cell(v, "latency_p50_s"), cell(v, "latency_p99_s"),
                 cell(v, "ttft_p50_s"), cell(v, "ttft_p99_s"), f"{v['num_waited'][0]:.0f}", cell(v, "queue_mean_s"),
                 cell(v, "queue_p99_s"), f"{v['tokens_per_s'][0]:.0f} ±{v['tokens_per_s'][1]:.0%}",
                 f"{v['preemptions_kv'][0]:.0f}", f"{v['preemptions_shorter_work'][0]:.0f}",
                 cell(v, "latency_mean_short_s"), cell(v, "latency_mean_medium_s"), cell(v, "latency_mean_long_s"),
                 cell(v, "step_ms")]
                for point, by_policy in medians[setting].items() for name, v in by_policy.items()]
        print(f"\n{setting} ({capacity[setting]['kv_tokens']} KV tokens, capacity "
              f"{capacity[setting]['requests_per_s']:.3f} requests/s): "
              f"{'modelled seconds' if config.clock == 'modelled' else 'seconds'}, medians of {config.rounds} rounds "
              f"(±: spread); waited: requests more than {WAITED_S} s in the queue; step_ms: the machine's speed, the "
              f"median step of {GAUGE_SEQUENCES[0]}-{GAUGE_SEQUENCES[1]} sequences")
        print(format_table(headers, rows))
    ratios_by_policy = {name: ratios_of(config, runs, name) for name in config.policies if name != "fcfs"}
    ratio_rows = []
    for name, by_setting in ratios_by_policy.items():
        for setting, by_point in by_setting.items():
            for point, values in by_point.items():
                ratio_rows.append([setting, point, name, *(
                    f"{values[key]['median']:.2f} [{values[key]['min']:.2f}-{values[key]['max']:.2f}]"
                    if key in values else "n/a" for key in (
                        "latency_mean_vs_fcfs", "ttft_p50_vs_fcfs", "latency_p99_vs_fcfs", "tokens_per_s_vs_fcfs",
                        "short_latency_mean_vs_fcfs", "oracle_share", "step_ms_vs_fcfs"))])
    print("\nagainst fcfs paging: median of the rounds' ratios [min-max]")
    print(format_table(["setting", "point", "policy", "lat_mean", "ttft_p50", "lat_p99", "tok/s", "short_lat_mean",
                        "oracle_share", "step_ms"], ratio_rows))
    print("(step_ms far from 1.00 where few waited: the machine's speed moved between the runs, or the policy's "
          "own time per step, not its order)")
    print(f"every engine: {config.max_num_seqs} slots, {config.max_num_batched_tokens} tokens per step, preemption "
          f"{config.preemption_mode} (swap within {config.swap_space_bytes / 1e6:.0f} MB, recompute beyond), "
          f"starvation bound {config.max_queue_wait_s:g} s, the same {WARMUP_REQUESTS} warm-up requests untimed; "
          f"the default predicts with {config.predictor!r} and the probe {config.probe!r}; oracle: the true lengths "
          f"(the ceiling); tokens per request "
          + ("identical under every run" if token_check["identical"] else
             f"DIFFER in {len(token_check['differing'])} runs, for {token_check['num_requests_differing']} of "
             f"{config.num_requests} requests (a batch's make-up moves {precision} rounding, and a near tie can "
             f"flip a greedy token)"))
    headline = ratios_by_policy.get("default", {})
    first = config.settings[0]
    result = {"benchmark": "latency", "model_precision": precision,
              "workload": {"name": "natural", **info, "num_requests": config.num_requests, "max_len": config.max_len,
                           "arrivals": "Poisson", "seed": config.seed,
                           "bursty_trace": str(config.trace_path) if config.bursty_load is not None else None},
              "config": {key: (str(value) if isinstance(value, Path) else value)
                         for key, value in dataclasses.asdict(config).items()},
              "capacity": capacity, "runs": runs, "medians": medians,
              "ratios": headline.get(first, {}), "ratios_by_setting": headline,
              "ratios_by_policy": ratios_by_policy, "identical_tokens": token_check, "environment": environment()}
    write_json(json_path, result)
    return result
