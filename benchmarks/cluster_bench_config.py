"""What `s3serve bench cluster` runs: its settings, their defaults and their checks (data only, so that the load
plan and the CLI share them without importing the bench)."""

import math
from dataclasses import dataclass
from pathlib import Path

from benchmarks.policy_summary import PROBE_SUFFIX, PROBED
from benchmarks.prompt_pool import DEFAULT_PROMPTS
from cluster.config import service_default
from cluster.control.rebalance import check_min_gap
from cluster.control.routing import DEFAULT_ROUTING, check_routing
from predictor_service.probe_files import check_probe_folder
from workers.engine.runtime import DTYPE_CHOICES
from workers.scheduling.policies import SERVING_POLICY_NAMES

POLICIES = SERVING_POLICY_NAMES
DEFAULT_TRACE = Path("../shared/data/traces/AzureLLMInferenceTrace_conv.csv")
# 256 blocks of 16 tokens of SmolLM2-135M (720 KiB each): 4 worst-case 1024-token sequences, as in bench policies.
DEFAULT_KV_CACHE_BYTES = 188_743_680
WORKLOADS = ("trace", "natural")
LATE = "/late"  # "s3_peak/late": the policy with the service's late binding on (`ServiceConfig.late_binding`)


@dataclass(frozen=True, slots=True)
class ClusterBenchConfig:
    """What `bench cluster` runs.

    Attributes:
        trace_path: Azure CSV or Mooncake JSONL trace.
        prompts_path: prompt texts the replayed prompts are cut from.
        policies: run in this order, one service each.
        num_workers: worker actors of each service.
        num_requests: first N trace rows.
        time_scale: arrival times are multiplied by this; 0 sends everything at t=0 (offline).
        max_len: the service's context; max_tokens of a request is max_len - its prompt.
        max_prompt_tokens: prompts are capped to this (reported).
        kv_cache_bytes: KV budget of each worker.
        concurrency: most requests the client keeps in flight.
        max_num_seqs: a worker's cap on running sequences (high: memory should bind).
        num_cpus: logical CPUs of the local Ray cluster.
        num_torch_threads: torch threads per worker.
        ready_timeout_s: how long a service may take to load its workers.
        predictor: "noisy-oracle:SIGMA" (the forced lengths with seeded log-normal error, served as a
            lookup artifact: the replayed prompt texts carry no information about those lengths),
            "default" (the service's shipped predictor) or a predictor artifact directory.
        quantile: coverage of the noisy oracle's upper bound.
        tokens_per_hash_id: traces with Mooncake hash ids: tokens of shared text per id (see the module docstring).
        urgent_share: share of requests sent as priority 0 (urgent), the rest as priority 5 (batch),
            spread evenly over the replay; 0 sends every request at the default priority 0. Latency is
            then also reported per class.
        workload: "trace" (forced trace lengths) or "natural" (see the module docstring).
        probe: the hidden-state probe the "+probe" policies run with ("default": the shipped one, or a folder).
        rebalance_min_gap: the services' `rebalance_min_gap` (0: no load rebalancing between workers).
        dtype: the workers' weights and KV dtype ("auto": bf16 where the CPU has it). In bf16 a greedy answer
            can change with what else is in its batch, so a request that moved or ran beside others may differ
            in its last tokens; "float32" makes the answers comparable token for token.
        routings: the services' `routing`s; with several, every policy runs once with each ("policy@routing").
    """

    trace_path: Path = DEFAULT_TRACE
    prompts_path: Path = DEFAULT_PROMPTS
    policies: tuple[str, ...] = ("s3", "max_reserve")
    num_workers: int = 2
    num_requests: int = 64
    time_scale: float = 1.0
    max_len: int = 1024
    max_prompt_tokens: int = 256
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES
    concurrency: int = 64
    max_num_seqs: int = 128
    num_cpus: int = 8
    num_torch_threads: int = 1
    ready_timeout_s: float = 900.0
    predictor: str = "noisy-oracle:0.3"
    quantile: float = service_default("quantile")
    tokens_per_hash_id: int = 16
    urgent_share: float = 0.0
    workload: str = "trace"
    probe: str = "default"
    rebalance_min_gap: int = service_default("rebalance_min_gap")
    dtype: str = service_default("dtype")
    routings: tuple[str, ...] = (DEFAULT_ROUTING,)

    @property
    def is_natural(self) -> bool:
        return self.workload == "natural"

    def check(self) -> None:
        """ValueError/FileNotFoundError showing the bad value, before anything starts."""
        if self.workload not in WORKLOADS:
            raise ValueError(f"--workload {self.workload!r}: choose one of {', '.join(WORKLOADS)}")
        probed = [f"{name}{PROBE_SUFFIX}" for name in PROBED]
        unknown = [p for p in self.policies
                   if p.removesuffix(LATE) not in (*POLICIES, *(probed if self.is_natural else ()))]
        if unknown or not self.policies:
            extra = f", {', '.join(probed)}" if self.is_natural else f" ({', '.join(probed)} with --workload natural)"
            raise ValueError(f"--policy {list(self.policies)}: choose one or more of {', '.join(POLICIES)}{extra}")
        if len(set(self.policies)) != len(self.policies):
            raise ValueError(f"--policy {list(self.policies)} names a policy twice")
        if any(p.removesuffix(LATE).endswith(PROBE_SUFFIX) for p in self.policies) and self.probe != "default":
            check_probe_folder(Path(self.probe).expanduser(), self.probe)
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"--dtype {self.dtype!r}: choose {', '.join(DTYPE_CHOICES)}")
        check_min_gap(self.rebalance_min_gap, "--rebalance-min-gap")
        for routing in self.routings:
            check_routing(routing)
        if self.is_natural and self.predictor.startswith("noisy-oracle:"):
            raise ValueError("--workload natural serves a real predictor (--predictor default or a directory): the "
                             "noisy oracle needs forced lengths")
        for name, path in (("--trace", self.trace_path), ("--prompts", self.prompts_path)):
            if not Path(path).is_file():
                raise FileNotFoundError(f"{name} {path} does not exist")
        for name, value in (("--workers", self.num_workers), ("--num-requests", self.num_requests),
                            ("--concurrency", self.concurrency), ("--kv-cache-bytes", self.kv_cache_bytes)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not (self.time_scale >= 0 and math.isfinite(self.time_scale)):
            raise ValueError(f"--time-scale must be a finite number >= 0, got {self.time_scale}")
        if self.predictor.startswith("noisy-oracle:"):
            try:
                sigma = float(self.predictor.split(":", 1)[1])
            except ValueError:
                raise ValueError(f"--predictor {self.predictor!r}: SIGMA must be a number, "
                                 "e.g. noisy-oracle:0.3") from None
            if sigma < 0:
                raise ValueError(f"--predictor {self.predictor!r}: SIGMA must be >= 0")
        elif self.predictor != "default" and not Path(self.predictor).is_dir():
            raise FileNotFoundError(f"--predictor {self.predictor}: not noisy-oracle:SIGMA, default, or a directory")
        if not 0.0 <= self.urgent_share <= 1.0:
            raise ValueError(f"--urgent-share must be in [0, 1], got {self.urgent_share}")
        if not 1 <= self.max_prompt_tokens < self.max_len:
            raise ValueError(
                f"--max-prompt-tokens must be in [1, --max-len={self.max_len}), got {self.max_prompt_tokens}")


def quick_config(**overrides) -> ClusterBenchConfig:
    return ClusterBenchConfig(**{"num_requests": 32, "max_prompt_tokens": 128, "time_scale": 0.0, **overrides})
