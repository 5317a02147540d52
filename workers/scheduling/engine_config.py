"""The engine's part of the settings tree: plain values with their checks, no torch.

`EngineConfig` holds the scheduler's `SchedulerConfig` and the cache's `CacheConfig`; the worker's
`WorkerSettings` holds an `EngineConfig` (`workers.values.setting` says how the tree is declared and read).
Worker settings validate them in the caller's process.
"""

import math
from dataclasses import dataclass

from workers.scheduling.preemption import PREEMPTION_MODES
from workers.values.setting import SettingsTree, setting

DEFAULT_SWAP_SPACE_BYTES = 1024**3
DEFAULT_MAX_QUEUE_WAIT_S = 30.0


@dataclass(frozen=True, slots=True)
class SchedulerConfig(SettingsTree):
    """Limits of one engine step (`workers.scheduling.scheduler.Scheduler`)."""

    max_num_seqs: int = setting(32, "most sequences a worker runs (holds KV blocks for) at once", unit="sequences")
    max_num_batched_tokens: int = setting(
        512, "most tokens in one forward: long prompts are prefilled in chunks that fit what the decodes leave of "
             "it", unit="tokens")
    max_overtaken_steps: int = setting(
        1024, "under a first-fit policy (s3, s3_peak) a waiting request that does not fit is passed by later ones "
              "that do; this many steps after the first time nobody passes it any more until it fits, so a large "
              "request is not starved by a stream of smaller ones", unit="steps")
    preempted_first: bool = setting(
        True, "under policies that take blocks on demand (all but s3, which reserves whole plans), a sequence "
              "preempted for want of KV goes back first in its class's queue and nobody passes it until it runs "
              "again, as vLLM requeues one; false: it waits in the policy's order, where first fit (s3_peak) lets "
              "smaller requests take the blocks it freed while its whole context waits to come back. Victims of "
              "preemption for a more urgent class or for shorter work wait in the policy's order either way")
    max_queue_wait_s: float = setting(
        DEFAULT_MAX_QUEUE_WAIT_S, "the starvation bound of both queues a request can wait in, the controller's (for "
                                  "a worker) and a worker's (for a slot and KV), each counting its own wait: a request "
                                  "that has waited this long goes ahead of every newer one. Under s3_peak the "
                                  "controller's queue otherwise goes shortest predicted work first, and a worker's "
                                  "shortest predicted remaining work first, aged so that a request is passed only by "
                                  "ones that arrived less than this long after it", unit="seconds")

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_overtaken_steps < 0:
            raise ValueError(f"max_overtaken_steps must be >= 0, got {self.max_overtaken_steps}")
        if not 0 <= self.max_queue_wait_s < math.inf:  # inf would age nobody: s3_peak's order would be arrival's
            raise ValueError(f"max_queue_wait_s must be finite and >= 0, got {self.max_queue_wait_s}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}) so every running sequence can decode each step"
            )


@dataclass(frozen=True, slots=True)
class CacheConfig(SettingsTree):
    """The KV cache's layout, sharing and preemption (`kv_cache_manager`, `preemption`)."""

    block_size: int = setting(16, "tokens per KV block (a power of two)", unit="tokens")
    prefix_caching: bool = setting(
        True, "share the KV of full blocks of prompt tokens between requests with the same prefix, and keep it "
              "after they finish until the blocks are needed (`workers.scheduling.prefix_cache`)")
    preemption_mode: str = setting(
        "auto", "how a preempted sequence gives up its KV, under every policy alike: auto (swap it to host memory "
                "or recompute it later, whichever is estimated cheaper for its length), swap, or recompute (vLLM "
                "V1's and SGLang's only mechanism)", choices=PREEMPTION_MODES)
    swap_space_bytes: int = setting(
        DEFAULT_SWAP_SPACE_BYTES, "host memory for the KV of swapped-out sequences (and of moved ones waiting "
                                  "here); a swap beyond it recomputes instead. With tensor parallelism, per rank",
        unit="bytes")

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}, "
                             f"got {self.preemption_mode!r}")
        if self.swap_space_bytes < 0:
            raise ValueError(f"swap_space_bytes must be >= 0, got {self.swap_space_bytes}")


@dataclass(frozen=True, slots=True)
class EngineConfig(SettingsTree):
    """Settings of one engine (`workers.engine.engine.Engine`); `EngineConfig.of(max_num_seqs=4, ...)` sets any leaf."""

    max_model_len: int | None = setting(
        None, "longest sequence (prompt + output); None takes the model's own limit (max_position_embeddings); "
              "the service caps it at what one worker's KV cache holds where that is known at start",
        unit="tokens")
    tensor_parallel_size: int = setting(
        1, "ranks (GPUs) one worker's engine runs over, on one node: DeepSpeed AutoTP shards the model and each "
           "rank holds 1/N of the KV heads (the KV memory is per rank); above 1 the Hugging Face stack runs",
        unit="ranks")
    use_fast_path: bool = setting(
        True, "run the model families the fast path serves through it (on the CPU fused C++ kernels and packed "
              "bf16 weights, on CUDA torch's ops and concatenated projections); off keeps the Hugging Face stack")
    kv_cache_bytes: int = setting(
        512 * 1024**2, "KV-cache budget across all layers, which sets the number of blocks; per rank. Sized on "
                       "the worker's device from its kv_cache_memory", unit="bytes", internal=True)
    cache_salt: str | None = setting(
        None, "names the model and dtype in every cached block's hash; None derives it from the model (workers "
              "pass `prefix_cache_salt(model, dtype)`, which routers share)", internal=True)
    scheduler: SchedulerConfig = setting(factory=SchedulerConfig)
    cache: CacheConfig = setting(factory=CacheConfig)

    def __post_init__(self) -> None:
        if self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes must be > 0, got {self.kv_cache_bytes}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
