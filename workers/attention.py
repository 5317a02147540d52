"""Paged attention plugged into Hugging Face models through `AttentionInterface`.

The engine runs one ragged forward per step: every scheduled token of every
sequence packed into a batch of one, prefill chunks first, then decodes:

    input_ids: [1, num_tokens]   = [ seq A chunk | seq B chunk | C | D | E ]
                                     <- prefill tokens ->   <- decodes ->

It passes an `AttentionBatch` as the `s3_batch` keyword of the model's forward;
transformers hands custom keywords through to the attention function of each
layer, which appends that layer's new K/V to the block pool and attends through
the block tables.
"""

from dataclasses import dataclass

import torch

from kv_kernels import KVKernelBackend

ATTENTION_NAME = "s3_paged"


@dataclass(slots=True)
class AttentionBatch:
    """Per-step attention metadata shared by all layers.

    Attributes:
        kv_caches: per layer (k_cache, v_cache), each [num_blocks, block_size, kv_heads, head_dim].
        backend: kernel implementation.
        slot_mapping: [num_tokens] cache slot of every token in the batch.
        num_prefill_tokens: leading tokens that belong to prefill chunks.
        cu_seqlens_q: [num_prefills + 1] chunk boundaries within the prefill tokens.
        prefill_prefix_lens: [num_prefills] tokens cached before each chunk.
        prefill_block_tables: [num_prefills, max_blocks]
        decode_block_tables: [num_decodes, max_blocks]
        decode_context_lens: [num_decodes] context length including the new token.
    """

    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    backend: KVKernelBackend
    slot_mapping: torch.Tensor
    num_prefill_tokens: int
    cu_seqlens_q: torch.Tensor
    prefill_prefix_lens: torch.Tensor
    prefill_block_tables: torch.Tensor
    decode_block_tables: torch.Tensor
    decode_context_lens: torch.Tensor


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    s3_batch: AttentionBatch | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """AttentionInterface function: query [1, H, T, D], key/value [1, KVH, T, D] -> [1, T, H, D]."""
    if s3_batch is None:
        raise ValueError(
            f"attention implementation {ATTENTION_NAME!r} needs the s3_batch keyword; "
            "this model is driven by the S3 engine, not by generate()"
        )
    batch = s3_batch
    k_cache, v_cache = batch.kv_caches[module.layer_idx]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    q = query[0].transpose(0, 1).contiguous()  # [T, H, D]
    k = key[0].transpose(0, 1).contiguous()  # [T, KVH, D]
    v = value[0].transpose(0, 1).contiguous()  # [T, KVH, D]
    batch.backend.append_kv(k, v, k_cache, v_cache, batch.slot_mapping)
    num_prefill = batch.num_prefill_tokens
    if num_prefill == q.shape[0]:
        out = batch.backend.prefill_attention(
            q, k_cache, v_cache, batch.cu_seqlens_q, batch.prefill_prefix_lens, batch.prefill_block_tables, scale
        )
    elif num_prefill == 0:
        out = batch.backend.paged_decode_attention(
            q, k_cache, v_cache, batch.decode_block_tables, batch.decode_context_lens, scale
        )
    else:
        prefill_out = batch.backend.prefill_attention(
            q[:num_prefill], k_cache, v_cache, batch.cu_seqlens_q, batch.prefill_prefix_lens,
            batch.prefill_block_tables, scale,
        )
        decode_out = batch.backend.paged_decode_attention(
            q[num_prefill:], k_cache, v_cache, batch.decode_block_tables, batch.decode_context_lens, scale
        )
        out = torch.cat([prefill_out, decode_out], dim=0)  # [T, H, D]
    return out.unsqueeze(0), None


def register_paged_attention() -> str:
    """Register the function with transformers (idempotent) and return its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    return ATTENTION_NAME
