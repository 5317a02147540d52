"""The worker's settings: the root of the settings tree (`workers.values.setting`), holding the engine's part.

Plain values with their checks, no torch and no Ray: the controller and the service's config import it.
"""

from dataclasses import dataclass, replace

from workers.engine.device import check_device
from workers.engine.models import DEFAULT_MODEL
from workers.engine.runtime import DTYPE_CHOICES
from workers.scheduling.engine_config import EngineConfig
from workers.scheduling.policies import DEFAULT_POLICY, POLICIES, make_policy, overcommit_options
from workers.scheduling.s3_policy import S3Policy
from workers.scheduling.preemption import PreemptionRule
from workers.scheduling.prefix_cache import prefix_cache_salt
from workers.scheduling.scheduling_policy import SchedulingPolicy
from workers.values.kv_memory import parse_kv_cache_memory
from workers.values.setting import SettingsTree, setting


@dataclass(frozen=True, slots=True)
class WorkerSettings(SettingsTree):
    """Everything needed to build a worker's engine inside the actor's process: the root of the settings tree
    (`workers.values.setting`), which holds the engine's part. `WorkerSettings.of(max_num_seqs=8, ...)` sets any leaf;
    the service's config is generated from the leaves that are not internal (`cluster.config`)."""

    model: str = setting(
        DEFAULT_MODEL, "'smollm2-135m-instruct' (the bundled SmolLM2, converted once), 'gemma3-270m' (Gemma 3 270M "
                       "base, Gemma terms apply; completions only: it has no chat template), a local Hugging Face "
                       "causal-LM folder, a .gguf file (converted once into model_cache_dir), or a hub id (org/name) "
                       "already in the local hub cache (nothing is downloaded; see revision)")
    tokenizer: str | None = setting(
        None, "where the tokenizer comes from instead of the model: a local folder with tokenizer files, a hub id in "
              "the local hub cache or a bundled model's name (as vLLM's --tokenizer)")
    revision: str | None = setting(
        None, "with a hub id as model: the branch, tag or commit of its snapshot in the local hub cache (default: "
              "the one refs/main names)")
    model_cache_dir: str | None = setting(
        None, "where bundled models and GGUF files are kept once converted (default: ~/.cache/s3serve/models)")
    policy: str = setting(
        DEFAULT_POLICY, "KV reservation policy of placement and workers: s3_peak (the default: blocks on demand, "
                        "admission by the predicted future peak of KV use, its queue shortest expected remaining work "
                        "first, preemption for much shorter work; with KV binding at 0.95 of its capacity it measured "
                        "0.76x paging's mean latency, 0.47x its first-token p50 and 1.03x its tokens/s, see "
                        "docs/benchmarks.md, bench latency), s3 (the paper's whole reservations, for reproduction), "
                        "paged_greedy (vLLM-style blocks on demand), "
                        "sglang_ratio or max_reserve (the worst case, every request at max_tokens)", choices=tuple(POLICIES))
    overcommit_step: float | None = setting(
        None, "s3_peak: share of a worker's KV pool its peak test's budget stretches by per step it refuses a "
              "request while nothing was preempted (None: the policy's 0.01 where preempted sequences may be "
              "swapped, 0 where they are only recomputed; 0: the peak always within the pool)",
        unit="share of the pool")
    kv_cache_memory: str | int = setting(
        "auto", "KV-cache memory of each worker (per rank), on the CPU and CUDA alike (vLLM's "
                "--gpu-memory-utilization, SGLang's --mem-fraction-static): a size (4GiB, 512MiB, or bytes), a share "
                "of the memory free once the model is loaded (0.5), or auto (on CUDA 0.9 of that; on the CPU room for "
                "max_num_seqs sequences of max_model_len tokens, at most 0.1 of the memory available). The ready "
                "message prints the KV tokens it gives")
    dtype: str = setting(
        "auto", "weights and KV dtype: auto (bfloat16 where the CPU has AVX512-BF16 or AMX; on CPUs with AVX2 "
                "only float32 arithmetic and KV over bfloat16 linear weights where the fast path serves the model, "
                "half the bytes a decode step reads; float32 elsewhere; on CUDA the model's own half type, else "
                "bfloat16), float32, bfloat16 or float16", choices=DTYPE_CHOICES)
    device: str = setting(
        "auto", "where the engine runs: auto (CUDA when the worker actor was given a GPU and torch sees one, else "
                "the CPU), cpu, cuda or cuda:N")
    num_torch_threads: int | None = setting(
        None, "torch intra-op threads of each worker (each rank); default: the cores it may use (the service shares "
              "the machine's cores among its most workers)", unit="threads")
    length_probe: str | None = setting(
        "auto", "workers re-predict each request's remaining output from the model's own hidden states after "
                "prefill and every 64 decoded tokens (under the policies that plan by predictions): auto (the "
                f"shipped probe when the model is the one it was trained for, {DEFAULT_MODEL}; otherwise off), "
                "default (the shipped probe), a folder from `s3serve probe train`, or none (off)")
    rank_stall_s: float = setting(
        300.0, "with tensor_parallel_size above 1: seconds rank 0 may wait inside one call the ranks share (a "
               "step's forward, a KV copy) before the worker counts as hung and is replaced, as when a rank dies",
        unit="seconds")
    bucket_tokens: int | None = setting(
        None, "s3 and s3_peak: the length buckets' width; None: a tenth of the length range, as the controller "
              "plans", unit="tokens", internal=True)
    tiny_model_seed: int | None = setting(
        None, "a tiny random Llama (`make_tiny_model(seed)`) instead of the model: fast tests", internal=True)
    tiny_model_init_std: float | None = setting(
        None, "with tiny_model_seed, its matrices redrawn at this std so that its tokens depend on the whole "
              "context (at its default init it echoes the last token)", internal=True)
    engine: EngineConfig = setting(factory=EngineConfig)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {self.dtype!r}")
        if self.num_torch_threads is not None and self.num_torch_threads < 1:
            raise ValueError(f"num_torch_threads must be >= 1 or None, got {self.num_torch_threads}")
        check_device(self.device)
        parse_kv_cache_memory(self.kv_cache_memory)
        if self.tiny_model_init_std is not None and self.tiny_model_init_std <= 0:
            raise ValueError(f"tiny_model_init_std must be > 0 or None, got {self.tiny_model_init_std}")
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        if self.bucket_tokens is not None and not issubclass(POLICIES[self.policy], S3Policy):
            raise ValueError(f"bucket_tokens applies to the s3 and s3_peak policies, not {self.policy!r}")
        if not self.rank_stall_s > 0:
            raise ValueError(f"rank_stall_s must be > 0, got {self.rank_stall_s}")
        self.make_policy()  # fail in the caller's process, not later inside the actor

    @property
    def probe(self) -> str | None:
        """The length probe the worker loads: auto is the shipped one for the model it was trained for, else none."""
        if self.length_probe == "auto":
            return "default" if self.model == DEFAULT_MODEL and self.tiny_model_seed is None else None
        return None if self.length_probe == "none" else self.length_probe

    def engine_config(self, kv_cache_bytes: int) -> EngineConfig:
        """The engine's settings, with the KV budget sized on the worker's device (`workers.values.kv_memory`)."""
        return replace(self.engine, kv_cache_bytes=kv_cache_bytes, cache_salt=prefix_cache_salt(self.model, self.dtype))

    def make_policy(self) -> SchedulingPolicy:
        """The worker's policy, built as the controller builds its own (same registry, same buckets)."""
        kwargs = {} if self.bucket_tokens is None else {"bucket_tokens": self.bucket_tokens}
        cache = self.engine.cache
        can_swap = PreemptionRule.can_swap(cache.preemption_mode, cache.swap_space_bytes)
        return make_policy(self.policy, max_model_len=self.engine.max_model_len,
                           **kwargs, **overcommit_options(self.policy, self.overcommit_step, can_swap))
