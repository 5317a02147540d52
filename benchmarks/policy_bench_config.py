"""What `s3serve bench policies` runs: its settings and their defaults (data only, so that the bench's parts, the
peers bench and the CLI share them without importing the bench)."""

from dataclasses import dataclass
from pathlib import Path

from benchmarks.natural_workload import HELD_OUT_LABELS
from benchmarks.prompt_pool import DEFAULT_PROMPTS
from cluster.config import service_default
from workers.scheduling.engine_config import DEFAULT_MAX_QUEUE_WAIT_S, DEFAULT_SWAP_SPACE_BYTES
from workers.scheduling.policies import POLICY_NAMES

POLICIES = POLICY_NAMES
DEFAULT_TRACE = Path("../shared/data/traces/AzureLLMInferenceTrace_conv.csv")


@dataclass(frozen=True, slots=True)
class PolicyBenchConfig:
    """What `bench policies` runs.

    Attributes:
        trace_path: Azure CSV or Mooncake JSONL trace.
        prompts_path: prompt texts the replayed prompts are cut from.
        num_requests: first N trace rows.
        max_len: longest sequence; max_tokens of every request is max_len - prompt.
        max_prompt_tokens: prompts are capped to this (reported).
        kv_cache_bytes: KV budget; None sizes it for `reserve_slots` worst-case sequences.
        reserve_slots: sequences max_reserve fits when kv_cache_bytes is None.
        mode: "offline" (all at t=0) or "online" (trace arrival times).
        time_scale: online arrival times are multiplied by this.
        predictor: "noisy-oracle:SIGMA" or an artifact directory.
        sweep_sigmas: extra s3 runs with noisy-oracle predictors of these sigmas.
        max_num_seqs: engine cap on running sequences (high: memory should bind).
        max_num_batched_tokens: engine tokens per step.
        seed: predictor noise seed.
        prefix_caching: the engines' prefix cache (on by default, as in the service).
        model_shape: a `workers.engine.model_shapes` name: a randomly initialised model of that shape replaces the
            model's weights (outputs are forced, so throughput does not depend on them); the tokenizer stays.
        device: where the engines run ("cpu" or "cuda"); a shaped model is built there (bf16 on CUDA).
        workload: "trace" (prompt text cut to the trace's lengths, outputs forced to them) or "natural"
            (held-out pool prompts run greedy to the model's own stop; `benchmarks.natural_workload`).
        labels_path: natural workload: the true lengths (the oracle's); missing prompts are labelled first.
        tokens_per_hash_id: with a trace that has Mooncake hash ids, prompts are built from them
            (each id this many tokens of shared text) and whole sessions are replayed
            (`benchmarks.traces.select_sessions`); paged_greedy, s3 and s3_peak then also run with
            the prefix cache off.
        probe: a hidden-state probe folder (`s3serve probe train`; "default": the shipped one): s3 and s3_peak
            run again with it refining their bounds in the engine, reported as s3+probe and s3_peak+probe.
        overcommit_step: s3_peak's budget stretch per refusing step (`S3PeakPolicy`; None: its default, 0 with
            `preemption_mode` recompute or no swap space; 0: the peak always within the pool).
        preemption_mode: how every policy's victims give up their KV (`CacheConfig.preemption_mode`): the same
            mechanism for all, so the policies differ only in their decisions.
        swap_space_bytes: host bytes swapped-out KV may hold at once, for every policy (`CacheConfig`).
        max_queue_wait_s: the starvation bound of every engine's queue (`SchedulerConfig`), which s3_peak's
            order ages by.
    """

    trace_path: Path = DEFAULT_TRACE
    prompts_path: Path = DEFAULT_PROMPTS
    num_requests: int = 64
    max_len: int = 1024
    max_prompt_tokens: int = 256
    kv_cache_bytes: int | None = None
    reserve_slots: int = 4
    mode: str = "offline"
    time_scale: float = 1.0
    predictor: str = "noisy-oracle:0.3"
    sweep_sigmas: tuple[float, ...] = ()
    policies: tuple[str, ...] = POLICIES
    max_num_seqs: int = 128
    max_num_batched_tokens: int = service_default("max_num_batched_tokens")
    seed: int = 0
    prefix_caching: bool = service_default("prefix_caching")
    tokens_per_hash_id: int = 16
    model_shape: str | None = None
    device: str = "cpu"
    workload: str = "trace"
    labels_path: Path = HELD_OUT_LABELS
    probe: str | None = None
    overcommit_step: float | None = service_default("overcommit_step")
    preemption_mode: str = service_default("preemption_mode")
    swap_space_bytes: int = DEFAULT_SWAP_SPACE_BYTES
    max_queue_wait_s: float = DEFAULT_MAX_QUEUE_WAIT_S


def quick_config(workload: str = "trace", **overrides) -> PolicyBenchConfig:
    """32 requests, prompts of at most 128 tokens; the natural workload also halves max_len to 512 (about half
    of SmolLM2's greedy answers run to the limit, so answers are long: 519 tokens on average at 1024)."""
    quick = {"num_requests": 32, "max_prompt_tokens": 128, "workload": workload}
    if workload == "natural":
        quick["max_len"] = 512
    return PolicyBenchConfig(**{**quick, **overrides})
