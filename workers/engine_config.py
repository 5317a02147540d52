"""Engine settings: plain values with their checks, no torch (worker settings validate them in the caller's process)."""

from dataclasses import dataclass

from workers.preemption import PREEMPTION_MODES

DEFAULT_SWAP_SPACE_BYTES = 1024**3


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Engine settings.

    Attributes:
        kv_cache_bytes: KV-cache budget across all layers; sets the number of blocks. With tensor
            parallelism, per rank (each rank holds 1/tp of the KV heads of every block).
        block_size: tokens per KV block.
        max_num_seqs: most sequences running at once.
        max_num_batched_tokens: most tokens per forward (prefill chunk budget).
        max_model_len: longest sequence (prompt + output); None takes the model's
            max_position_embeddings.
        tensor_parallel_size: ranks one engine runs over, DeepSpeed AutoTP in each; torch.distributed
            must run that many, the engine on rank 0 and `workers.tensor_parallel.follow_engine` on the
            others. Above 1 the Hugging Face stack runs (no fast path).
        use_fast_path: run the models `FastDecoder` serves through it (on CPU fused C++ kernels and
            packed bf16 weights, on CUDA torch's ops and concatenated projections); False keeps
            the Hugging Face module stack.
        enable_prefix_caching: share the KV of full blocks of tokens between requests with the
            same prefix, and keep it after they finish until the blocks are needed
            (`workers.prefix_cache`).
        cache_salt: names the model and dtype in every cached block's hash; None derives it from
            the model (the service passes `prefix_cache_salt(model, dtype)`, which routers share).
        max_overtaken_steps: steps after a waiting sequence is first passed by later ones (under s3
            and s3_peak) before nobody passes it any more (`SchedulerConfig.max_overtaken_steps`).
        preemption_mode: how a preempted sequence gives up its KV under every policy alike: "auto" (swap or
            recompute, whichever is estimated cheaper for its length), "swap" or "recompute"
            (`workers.preemption.PreemptionRule`).
        swap_space_bytes: host memory for the KV of swapped-out sequences (and of moved ones waiting here), in
            bytes; a swap that would exceed it recomputes instead (counted). With tensor parallelism, per rank.
    """

    kv_cache_bytes: int = 512 * 1024**2
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    tensor_parallel_size: int = 1
    use_fast_path: bool = True
    enable_prefix_caching: bool = True
    cache_salt: str | None = None
    max_overtaken_steps: int = 1024
    preemption_mode: str = "auto"
    swap_space_bytes: int = DEFAULT_SWAP_SPACE_BYTES

    def __post_init__(self) -> None:
        if self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes must be > 0, got {self.kv_cache_bytes}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.max_overtaken_steps < 0:
            raise ValueError(f"max_overtaken_steps must be >= 0, got {self.max_overtaken_steps}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {', '.join(PREEMPTION_MODES)}, "
                             f"got {self.preemption_mode!r}")
        if self.swap_space_bytes < 0:
            raise ValueError(f"swap_space_bytes must be >= 0, got {self.swap_space_bytes}")
