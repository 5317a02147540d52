"""Torch reference implementations of the KV-cache operations.

These run on any device and define the semantics the Triton and CPU kernels
must match. Every public function validates its arguments with
`kv_kernels.checks` first; the engine calls the unchecked `_...` versions
through `attention()`, after validating the step's metadata once.
Layout: see `kv_kernels.layout`.
"""

import torch
import torch.nn.functional as F

from kv_kernels import checks
from kv_kernels.attention_metadata import AttentionMetadata


def append_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write new K/V rows into their slots.

    Args:
        key, value: [num_tokens, num_kv_heads, head_dim]
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], written in place.
        slot_mapping: [num_tokens] slot of each token (block_id * block_size + offset).
    """
    checks.check_append(key, value, k_cache, v_cache, slot_mapping)
    _append_kv(key, value, k_cache, v_cache, slot_mapping)


def _append_kv(key, value, k_cache, v_cache, slot_mapping) -> None:
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    slots = slot_mapping.long()
    # flat views: [num_blocks * block_size, num_kv_heads, head_dim]
    k_cache.view(num_blocks * block_size, num_kv_heads, head_dim).index_copy_(0, slots, key)
    v_cache.view(num_blocks * block_size, num_kv_heads, head_dim).index_copy_(0, slots, value)


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence attending to its cached context (GQA).

    Args:
        query: [num_seqs, num_heads, head_dim]
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
        block_tables: [num_seqs, max_blocks_per_seq] block ids; entries past a
            sequence's last block are ignored (any valid id, e.g. 0).
        context_lens: [num_seqs] tokens each query attends to (its own included).
        scale: softmax scale, usually head_dim ** -0.5.

    Returns:
        [num_seqs, num_heads, head_dim]
    """
    checks.check_decode(query, k_cache, v_cache, block_tables, context_lens)
    return _paged_decode_attention(query, k_cache, v_cache, block_tables, context_lens, scale,
                                   max(context_lens.tolist(), default=0))


def _paged_decode_attention(query, k_cache, v_cache, block_tables, context_lens, scale, max_context_len: int,
                            window: int = 0):
    """One batched attention call for every sequence: contexts padded to the longest and masked; with `window`,
    each query sees only its last `window` keys, its own included (a sliding window)."""
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_seqs == 0:
        return torch.empty_like(query)
    num_blocks = -(-max_context_len // block_size)
    table = block_tables[:, :num_blocks].long()  # [S, W]
    # keys, values: [S, KVH, W * block_size, D]; slots past a context are masked below
    keys = k_cache[table].reshape(num_seqs, num_blocks * block_size, num_kv_heads, head_dim).transpose(1, 2)
    values = v_cache[table].reshape(num_seqs, num_blocks * block_size, num_kv_heads, head_dim).transpose(1, 2)
    positions = torch.arange(num_blocks * block_size, device=query.device)
    visible = positions[None, :] < context_lens[:, None]  # [S, L]
    if window > 0:
        visible = visible & (positions[None, :] >= context_lens[:, None] - window)
    mask = visible[:, None, :, None]  # [S, 1, L, 1]
    # Stale slots past a context may hold anything (inf, nan): zero them, since a masked
    # probability of 0 times inf is still nan.
    keys = torch.where(mask, keys.float(), 0.0)
    values = torch.where(mask, values.float(), 0.0)
    out = F.scaled_dot_product_attention(
        query.unsqueeze(2).float(), keys, values, attn_mask=mask.transpose(2, 3), scale=scale, enable_gqa=True
    )  # [S, H, 1, D]
    return out[:, :, 0].to(query.dtype)


def prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    prefix_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention for ragged query chunks over cached prefix + the chunk itself.

    The chunk's own K/V must already be appended to the cache. Query token j of
    sequence i sits at position prefix_lens[i] + j and attends to cached
    positions 0 .. prefix_lens[i] + j, so chunked prefill and sequences resumed
    after a swap need no special case.

    Args:
        query: [num_tokens, num_heads, head_dim], sequences packed back to back.
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
        cu_seqlens_q: [num_seqs + 1] cumulative query lengths, starting at 0.
        prefix_lens: [num_seqs] tokens already cached before each chunk.
        block_tables: [num_seqs, max_blocks_per_seq]
        scale: softmax scale.

    Returns:
        [num_tokens, num_heads, head_dim]
    """
    checks.check_prefill(query, k_cache, v_cache, cu_seqlens_q, prefix_lens, block_tables)
    return _prefill_attention(query, k_cache, v_cache, cu_seqlens_q.tolist(), prefix_lens.tolist(), block_tables,
                              scale)


def _prefill_attention(query, k_cache, v_cache, bounds: list[int], prefixes: list[int], block_tables, scale,
                       window: int = 0):
    """Chunk by chunk (prefill chunks are few per step); `bounds`/`prefixes` are host lists. With `window`, query
    position p sees keys p - window + 1 .. p (a sliding window)."""
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    out = torch.empty_like(query)
    for seq, prefix_len in enumerate(prefixes):
        start, end = bounds[seq], bounds[seq + 1]
        query_len = end - start
        if query_len == 0:
            continue
        context_len = prefix_len + query_len
        num_blocks = -(-context_len // block_size)
        table = block_tables[seq, :num_blocks].long()
        # keys, values: [KVH, context_len, D]
        keys = k_cache[table].view(-1, num_kv_heads, head_dim)[:context_len].transpose(0, 1)
        values = v_cache[table].view(-1, num_kv_heads, head_dim)[:context_len].transpose(0, 1)
        q = query[start:end].transpose(0, 1)  # [H, Q, D]
        if prefix_len == 0 and not 0 < window < context_len:
            mask = None
            is_causal = query_len > 1
        else:
            query_positions = torch.arange(prefix_len, context_len, device=query.device)
            key_positions = torch.arange(context_len, device=query.device)
            mask = key_positions[None, :] <= query_positions[:, None]  # [Q, L]
            if window > 0:
                mask = mask & (key_positions[None, :] > query_positions[:, None] - window)
            is_causal = False
        attended = F.scaled_dot_product_attention(
            q[None], keys[None], values[None], attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=True
        )  # [1, H, Q, D]
        out[start:end] = attended[0].transpose(0, 1)
    return out


def row_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Greedy decoding's pick: the index of each row's largest logit, [N, V] -> [N] int64 (the first of equals; a
    NaN before any number)."""
    return torch.max(logits, dim=-1).indices  # 5x faster than argmax on bf16 CPU logits


def copy_blocks(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    src_block_ids: torch.Tensor,
    dst_block_ids: torch.Tensor,
) -> None:
    """Copy whole blocks within one layer's pool (copy-on-write, defragmentation).

    Args:
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], written in place.
        src_block_ids, dst_block_ids: [num_copies]; destinations must be distinct.
    """
    checks.check_copy(k_cache, v_cache, src_block_ids, dst_block_ids)
    src, dst = src_block_ids.long(), dst_block_ids.long()
    k_cache[dst] = k_cache[src]
    v_cache[dst] = v_cache[src]


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Pack blocks into a contiguous staging tensor on the cache's device.

    Args:
        cache: [num_blocks, block_size, num_kv_heads, head_dim]
        block_ids: [num_selected]

    Returns:
        [num_selected, block_size, num_kv_heads, head_dim]
    """
    checks.check_gather(cache, block_ids)
    return cache[block_ids.long()].contiguous()


def scatter_blocks(cache: torch.Tensor, block_ids: torch.Tensor, blocks: torch.Tensor) -> None:
    """Unpack a staging tensor into the given blocks of the cache, in place.

    Args:
        cache: [num_blocks, block_size, num_kv_heads, head_dim]
        block_ids: [num_selected]
        blocks: [num_selected, block_size, num_kv_heads, head_dim] on the cache's device.
    """
    checks.check_scatter(cache, block_ids, blocks)
    cache[block_ids.long()] = blocks


def attention(query, key, value, k_cache, v_cache, meta: AttentionMetadata, scale: float,
              window: int = 0) -> torch.Tensor:
    """A whole step for one layer: append the step's K/V, then attend. query [T, H, D] -> [T, H, D].

    `window` > 0: each query sees only its last `window` keys, its own included (a sliding-window layer, as
    Hugging Face's `kv_idx > q_idx - sliding_window`); 0: the whole context.
    Unchecked: the engine validated `meta` once for the step (`build_attention_metadata`).
    """
    _append_kv(key, value, k_cache, v_cache, meta.slot_mapping)
    num_prefill = meta.num_prefill_tokens
    parts = []
    if meta.num_prefills:
        starts = [0]
        for length in meta.query_lens_host[: meta.num_prefills]:
            starts.append(starts[-1] + length)
        prefixes = [s - q for s, q in zip(meta.seq_lens_host, meta.query_lens_host[: meta.num_prefills])]
        parts.append(_prefill_attention(query[:num_prefill], k_cache, v_cache, starts, prefixes,
                                        meta.prefill_block_tables, scale, window))
    if meta.num_seqs > meta.num_prefills:
        parts.append(_paged_decode_attention(query[num_prefill:], k_cache, v_cache, meta.decode_block_tables,
                                             meta.decode_context_lens, scale,
                                             max(meta.seq_lens_host[meta.num_prefills:]), window))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
