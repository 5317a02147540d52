"""How far a decode step is from what this CPU allows: measured limits and a step's bytes and FLOPs.

Two limits bind a decoder step. Memory: every weight matrix, and every sequence's
cached K and V, is read once per step, so a step takes at least bytes / bandwidth.
Compute: each new token costs 2 FLOPs per matmul weight plus attention over its
context, so a step takes at least FLOPs / peak. The larger of the two is the
step's floor; `share_of_limit` is that floor over the time the step took (1.0: at
the roofline; 0.25: four times slower than the hardware allows).

The limits are measured here, once per bench (`measure_limits`), not read from a
datasheet: bandwidth by summing a buffer far larger than any cache (a read-only
stream, as decoding reads weights), peak by square matmuls in the engine's dtype.
Each is the best of a few repetitions: a capability, not a comparison.
"""

import time
from dataclasses import dataclass

GIGA = 1e9


@dataclass(frozen=True, slots=True)
class DecoderShape:
    """What a decode step's cost depends on.

    Attributes:
        matmul_params: weights multiplied per token (every linear layer and the LM head; the input
            embedding only through a tied head).
        head_params: the LM head's share of them (a prefill computes logits for its last token only).
        num_layers, num_heads, num_kv_heads, head_dim: attention's shape.
        bytes_per_param: bytes of one weight (2 for bf16, 4 for fp32).
        kv_bytes_per_token: bytes of one token's K and V over all layers.
    """

    matmul_params: int
    head_params: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    bytes_per_param: int
    kv_bytes_per_token: int

    @classmethod
    def of(cls, config, total_params: int, bytes_per_param: int, kv_bytes_per_token: int) -> "DecoderShape":
        """From a Hugging Face decoder config and the model's parameter count."""
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        embedding = config.vocab_size * config.hidden_size
        tied = bool(getattr(config, "tie_word_embeddings", False))
        matmul = total_params if tied else total_params - embedding  # the head is the embedding, or its own matrix
        return cls(matmul, embedding, config.num_hidden_layers, config.num_attention_heads,
                   getattr(config, "num_key_value_heads", None) or config.num_attention_heads, head_dim,
                   bytes_per_param, kv_bytes_per_token)


@dataclass(frozen=True, slots=True)
class StepCost:
    """Bytes a step must read and FLOPs it must do."""

    bytes: float
    flops: float


def run_cost(shape: DecoderShape, steps: int, prompt_tokens: int, output_tokens: int) -> StepCost:
    """A lower bound on a whole run's cost: each step reads the weights once; every prompt and output token
    goes through the layers, only output tokens through the head (attention and KV reads left out)."""
    layer_params = shape.matmul_params - shape.head_params
    return StepCost(steps * shape.matmul_params * shape.bytes_per_param,
                    2 * layer_params * (prompt_tokens + output_tokens) + 2 * shape.head_params * output_tokens)


def decode_step_cost(shape: DecoderShape, context_tokens: list[int]) -> StepCost:
    """One decode step of len(context_tokens) sequences, each attending over its context: the weights once,
    each sequence's K and V once; 2 FLOPs per weight per token, and Q.K plus P.V per head and context token."""
    batch, context = len(context_tokens), sum(context_tokens)
    weight_bytes = shape.matmul_params * shape.bytes_per_param
    attention_flops = 4 * shape.num_layers * shape.num_heads * shape.head_dim * context
    return StepCost(weight_bytes + context * shape.kv_bytes_per_token,
                    2 * shape.matmul_params * batch + attention_flops)


@dataclass(frozen=True, slots=True)
class Limits:
    """This machine's measured limits."""

    bandwidth_gbs: float
    peak_gflops: float

    def floor_s(self, cost: StepCost) -> float:
        """The least time the cost can take: the binding limit's."""
        return max(cost.bytes / (self.bandwidth_gbs * GIGA), cost.flops / (self.peak_gflops * GIGA))

    def bound(self, cost: StepCost) -> str:
        """Which limit binds: "memory" or "compute"."""
        return "memory" if cost.bytes / self.bandwidth_gbs >= cost.flops / self.peak_gflops else "compute"

    def judge(self, cost: StepCost, seconds: float) -> dict:
        """What a step of this cost, taking `seconds`, achieved against the limits."""
        return {"achieved_gbs": cost.bytes / seconds / GIGA, "achieved_gflops": cost.flops / seconds / GIGA,
                "intensity_flops_per_byte": cost.flops / cost.bytes, "bound": self.bound(cost),
                "floor_ms": self.floor_s(cost) * 1e3, "share_of_limit": self.floor_s(cost) / seconds}


def _best_seconds(work, repeats: int) -> float:
    work()  # first touch and warm-up
    best = float("inf")
    for _ in range(repeats):
        start_s = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - start_s)
    return best


def measure_bandwidth_gbs(buffer_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Read bandwidth: a sum over a float32 buffer (default 1 GiB, far past any cache), best of `repeats`."""
    import torch

    buffer = torch.ones(buffer_bytes // 4, dtype=torch.float32)
    seconds = _best_seconds(lambda: buffer.sum(), repeats)
    return buffer_bytes / seconds / GIGA


HOST_PROBE_BYTES = 256 << 20


def host_bandwidth_gbs() -> float:
    """This machine's read bandwidth now: a 256 MiB sum, best of 3 (a few tenths of a second). Taken around each
    run of a comparison, it shows how much of the memory the engines share other tenants were taking then."""
    return measure_bandwidth_gbs(HOST_PROBE_BYTES, repeats=3)


def measure_peak_gflops(dtype, size: int = 2048, repeats: int = 5) -> float:
    """Matmul throughput in `dtype`: [size, size] x [size, size] (2 size^3 FLOPs), best of `repeats`."""
    import torch

    a = torch.randn(size, size).to(dtype)  # [size, size]
    b = torch.randn(size, size).to(dtype)  # [size, size]
    seconds = _best_seconds(lambda: torch.mm(a, b), repeats)
    return 2 * size**3 / seconds / GIGA


def measure_limits(dtype) -> Limits:
    """This machine's bandwidth and its peak matmul throughput in the engine's dtype."""
    return Limits(measure_bandwidth_gbs(), measure_peak_gflops(dtype))
