"""Paged attention for one engine step, for both forwards the engine runs.

The engine runs one ragged forward per step: every scheduled token of every
sequence packed into one batch, prefill chunks first, then decodes:

    input_ids: [num_tokens]   = [ seq A chunk | seq B chunk | C | D | E ]
                                  <- prefill tokens ->   <- decodes ->

`StepAttention` holds what every layer of that step shares (the KV pool, the
backend, the metadata validated once for the step) and attends for one layer
per call. The fast path (`workers.engine.fast_decoder`) calls it directly; a Hugging Face
module stack reaches it through `AttentionInterface`, which hands the
`s3_attention` keyword of the model's forward to the attention function of
every layer.
"""

import time
from dataclasses import dataclass, field

import torch

from kv_kernels import AttentionMetadata, KVKernelBackend

ATTENTION_NAME = "s3_paged"


@dataclass(slots=True)
class StepAttention:
    """Attention of one step, layer by layer.

    Attributes:
        kv_caches: per layer (k_cache, v_cache), each [num_blocks, block_size, kv_heads, head_dim].
        backend: kernel implementation.
        meta: the step's metadata (validated once when built).
        elapsed_s: time spent inside attention this step (the profile's "attention").
    """

    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    backend: KVKernelBackend
    meta: AttentionMetadata
    elapsed_s: float = field(default=0.0)

    def __call__(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 scale: float, window: int = 0) -> torch.Tensor:
        """query [T, H, D], key/value [T, KVH, D] -> [T, H, D]; writes key/value into the pool. `window` > 0: the
        layer attends within a sliding window of that many keys."""
        start_s = time.perf_counter()
        k_cache, v_cache = self.kv_caches[layer_idx]
        out = self.backend.attention(query, key, value, k_cache, v_cache, self.meta, scale, window)
        self.elapsed_s += time.perf_counter() - start_s
        return out


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    s3_attention: StepAttention | None = None,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """AttentionInterface function: query [1, H, T, D], key/value [1, KVH, T, D] -> [1, T, H, D].

    `sliding_window`: what a sliding-window layer passes (Mistral, Qwen2, Phi-3, Gemma 3's local layers): each
    query sees keys at positions > its own - sliding_window. Anything the model asks that our attention does
    not do was refused when the model was loaded (`workers.values.model_support`).
    """
    if s3_attention is None:
        raise ValueError(
            f"attention implementation {ATTENTION_NAME!r} needs the s3_attention keyword; "
            "this model is driven by the S3 engine, not by generate()"
        )
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    q, k, v = _token_rows(query), _token_rows(key), _token_rows(value)  # [T, H, D], [T, KVH, D], [T, KVH, D]
    return s3_attention(module.layer_idx, q, k, v, scale, int(sliding_window or 0)).unsqueeze(0), None


def _token_rows(x: torch.Tensor) -> torch.Tensor:
    """[1, heads, T, D] -> [T, heads, D] with each token's heads packed ([T, heads * D] memory).

    `.contiguous()` alone is not enough with one head (a tensor-parallel rank's share of the KV
    heads, or multi-query attention): a size-1 dimension may keep any stride and still count as
    contiguous, while the kernels read a token's heads as one row.
    """
    rows = x[0].transpose(0, 1)
    num_tokens, num_heads, head_dim = rows.shape
    return rows.reshape(num_tokens, num_heads * head_dim).view(num_tokens, num_heads, head_dim)


def register_paged_attention() -> str:
    """Register the function with transformers (idempotent) and return its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    return ATTENTION_NAME
