"""One replay of `bench policies`: a fresh engine, one policy (optionally with the hidden-state probe), the
requests fed at their arrival times, and what it measured.

Every replay is on the same footing: the same preemption mechanism and swap budget whatever the policy
(`PolicyBenchConfig.preemption_mode`, `swap_space_bytes`), and the same untimed warm-up on its fresh engine
(`WARMUP_REQUESTS` short requests whose prompts share no block with the workload's) before the clock starts.
"""

import time
from dataclasses import dataclass, field

from tqdm import tqdm

from benchmarks.modelled_clock import ModelledClock
from benchmarks.natural_workload import output_digest
from benchmarks.policy_bench_config import PolicyBenchConfig
from benchmarks.policy_summary import NO_CACHE_SUFFIX, PROBE_SUFFIX
from workers.engine.engine import Engine
from workers.scheduling.engine_config import EngineConfig
from workers.scheduling.length_probe import LengthProbe
from workers.scheduling.policies import make_policy, overcommit_options
from workers.scheduling.preemption import PreemptionRule
from workers.scheduling.scheduler_output import SchedulerStats
from workers.values.sampling_params import SamplingParams
from workers.values.step_output import StepShape

MAX_REPORTED_EVENTS = 50  # misprediction events listed per policy in the JSON
WARMUP_REQUESTS = 2  # untimed, through every fresh engine before its replay
WARMUP_PROMPT_TOKENS = 24
WARMUP_OUTPUT_TOKENS = 8


@dataclass(slots=True)
class PolicyRun:
    """Raw measurements of one policy."""

    policy: str
    wall_s: float = 0.0
    output_tokens: int = 0
    # (end of step s, step duration s, sequences in the step, used blocks, reserved blocks); idle
    # gaps of online replay are steps with no sequence.
    steps: list[tuple[float, float, int, int, int]] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    latency_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    latency_s_by_request: dict[str, float] = field(default_factory=dict)
    queue_s: list[float] = field(default_factory=list)  # each request's wait in the engine's queue before admission
    num_preemptions: int = 0
    preemptions_by_cause: dict[str, int] = field(default_factory=dict)  # `SchedulerStats.preemptions_by_cause`
    num_recomputed_tokens: int = 0
    swapped_bytes: int = 0
    swap_space_peak_bytes: int = 0  # the most swapped-out KV held on the host at once (bounded by the budget)
    num_swaps_over_budget: int = 0  # preemptions that recomputed because swap space was full
    num_mispredictions: int = 0
    misprediction_events: list[dict] = field(default_factory=list)
    num_blocks: int = 0
    outputs_ok: bool = True
    prefix_caching: bool = True
    num_prompt_tokens: int = 0  # at first admission
    num_prefix_hit_tokens: int = 0  # of those, taken from the prefix cache
    digests: dict[str, str] = field(default_factory=dict)  # request id -> fingerprint of its output tokens
    num_probe_reads: int = 0  # bounds the hidden-state probe set (after prefill and every N decoded tokens)
    measured_steps: list[tuple[StepShape, float]] = field(default_factory=list)  # (shape, wall s) of each step


def warm_up_prompts(vocab_size: int) -> list[list[int]]:
    """The warm-up's prompts: token ids from the top of the vocabulary, in an order no text makes (no prefix
    block in common with any workload); a peer engine gets the same ones."""
    return [[vocab_size - 1 - (7 * index + 3 * j) % 97 for j in range(WARMUP_PROMPT_TOKENS)]
            for index in range(WARMUP_REQUESTS)]


def warm_up(engine: Engine, vocab_size: int) -> None:
    """Run `WARMUP_REQUESTS` short requests through `engine`, untimed, then zero what a replay counts."""
    for index, prompt in enumerate(warm_up_prompts(vocab_size)):
        # Forced and predicted exactly, so that every policy (the oracle too) takes them.
        engine.add_request(prompt, SamplingParams(max_tokens=WARMUP_OUTPUT_TOKENS, ignore_eos=True,
                                                  forced_output_tokens=WARMUP_OUTPUT_TOKENS),
                           seq_id=f"warmup-{index}", predicted_output_tokens=WARMUP_OUTPUT_TOKENS)
    while engine.has_unfinished():
        engine.step()
    engine.scheduler.stats = SchedulerStats()
    engine.scheduler.swap_space.peak_blocks = 0
    engine.swapped_bytes = 0
    engine.num_probe_reads = 0


def run_policy(model, name: str, requests, estimates: dict[str, tuple[int, int]], config: PolicyBenchConfig,
               kv_cache_bytes: int, progress: tqdm, prefix_caching: bool = True,
               probe: LengthProbe | None = None, policy_options: dict | None = None,
               label: str | None = None, engine_options: dict | None = None,
               clock: ModelledClock | None = None) -> PolicyRun:
    """Replay the requests through a fresh engine with one policy (and `probe` refining its bounds, if given).

    `estimates` holds each request's (point, upper bound) output tokens; the policy plans by the one it
    chooses (`PlanningRule.prediction_from`). `policy_options`: the policy's own constructor arguments (a
    variant); `engine_options`: settings of the engine's tree the variant sets (`EngineConfig.of`); `label`: the
    run's name (default: the policy's, "+probe" with a probe); `clock`: time as a step-time model counts it
    instead of the wall clock (arrivals, steps, latencies; `measured_steps` stay on the wall clock)."""
    natural = config.workload == "natural"
    kwargs = overcommit_options(name, config.overcommit_step,
                                PreemptionRule.can_swap(config.preemption_mode, config.swap_space_bytes))
    if name == "oracle" and natural:
        kwargs = {"from_prediction": True}  # `estimates` hold the labelled lengths; nothing is forced
    policy = make_policy(name, max_model_len=config.max_len, **{**kwargs, **(policy_options or {})})
    engine = Engine(
        model,
        EngineConfig.of(kv_cache_bytes=kv_cache_bytes, max_num_seqs=config.max_num_seqs,
                     max_num_batched_tokens=config.max_num_batched_tokens, max_model_len=config.max_len,
                     prefix_caching=prefix_caching, preemption_mode=config.preemption_mode,
                     swap_space_bytes=config.swap_space_bytes, max_queue_wait_s=config.max_queue_wait_s,
                     **(engine_options or {})),
        policy=policy,
        probe=probe,
        clock=clock,
    )
    warm_up(engine, engine.vocab_size)
    now = engine.clock.now
    label = label or (name if probe is None else f"{name}{PROBE_SUFFIX}")
    run = PolicyRun(policy=label if prefix_caching else f"{label}{NO_CACHE_SUFFIX}", num_blocks=engine.allocator.num_blocks,
                    prefix_caching=prefix_caching)
    pending = sorted(requests, key=lambda r: r.arrival_s)
    expected = {r.request_id: r.output_tokens for r in requests}
    start_s = now()
    next_index = 0
    while next_index < len(pending) or engine.has_unfinished():
        now_s = now() - start_s
        while next_index < len(pending) and pending[next_index].arrival_s <= now_s:
            request = pending[next_index]
            max_tokens = config.max_len - len(request.prompt_token_ids)
            engine.add_request(
                list(request.prompt_token_ids),
                SamplingParams(max_tokens=max_tokens) if natural else  # greedy, to the model's own stop
                SamplingParams(max_tokens=max_tokens, ignore_eos=True, forced_output_tokens=request.output_tokens),
                seq_id=request.request_id,
                predicted_output_tokens=(policy.prediction_from(*estimates[request.request_id])
                                         if request.request_id in estimates else None),
                arrival_s=start_s + request.arrival_s,
            )
            next_index += 1
        if not engine.has_unfinished():
            idle_s = max(0.0, pending[next_index].arrival_s - now_s)
            engine.clock.wait_until(start_s + pending[next_index].arrival_s)
            run.steps.append((now() - start_s, idle_s, 0, 0, 0))
            continue
        step_start_s, wall_start_s = now(), time.perf_counter()
        outputs = engine.step()
        wall_step_s, now_s = time.perf_counter() - wall_start_s, now()
        if engine.last_num_scheduled:
            run.measured_steps.append((engine.last_shape, wall_step_s))
        run.steps.append((now_s - start_s, now_s - step_start_s, engine.last_num_scheduled,
                          engine.last_used_blocks, engine.last_reserved_blocks))
        for out in outputs:
            if out.is_finished:
                metrics = out.metrics
                run.output_tokens += metrics.num_output_tokens
                run.outputs_ok &= metrics.num_output_tokens == expected[out.seq_id]
                run.digests[out.seq_id] = output_digest(out.output_token_ids)
                run.ttft_s.append(metrics.ttft_s)
                run.latency_s.append(metrics.latency_s)
                run.latency_s_by_request[out.seq_id] = metrics.latency_s
                if metrics.queue_s is not None:
                    run.queue_s.append(metrics.queue_s)
                if metrics.tpot_s is not None:
                    run.tpot_s.append(metrics.tpot_s)
                progress.update(1)
    run.wall_s = now() - start_s
    stats = engine.scheduler.stats
    run.num_preemptions = stats.num_preemptions
    run.preemptions_by_cause = dict(stats.preemptions_by_cause)
    run.num_recomputed_tokens = stats.num_recomputed_tokens
    run.swapped_bytes = engine.swapped_bytes
    run.swap_space_peak_bytes = engine.scheduler.swap_space.peak_blocks * engine.runner.pool_shape.bytes_per_block
    run.num_swaps_over_budget = stats.num_swaps_over_budget
    run.num_mispredictions = len(stats.mispredictions)
    run.num_probe_reads = engine.num_probe_reads
    run.num_prompt_tokens = stats.num_prompt_tokens_admitted
    run.num_prefix_hit_tokens = stats.num_prefix_hit_tokens
    run.misprediction_events = [
        {"request_id": e.seq_id, "predicted_output_tokens": e.predicted_output_tokens,
         "output_tokens_so_far": e.num_output_tokens, "step": e.step}
        for e in stats.mispredictions[:MAX_REPORTED_EVENTS]
    ]
    return run
