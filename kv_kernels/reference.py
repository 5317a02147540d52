"""Torch reference implementations of the KV-cache operations.

These run on any device and define the semantics the Triton kernels must
match; the engine uses them on CPU. Every function validates its arguments
with `kv_kernels.checks` first. Layout: see `kv_kernels.layout`.
"""

import torch
import torch.nn.functional as F

from kv_kernels import checks


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
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group_size = num_heads // num_kv_heads
    context_list = context_lens.tolist()
    blocks_per_seq = [-(-n // block_size) for n in context_list]
    # One gather of exactly the blocks in use, sequence after sequence; no
    # padding to the longest context (on CPU the padded batch costs ~3x).
    in_use = torch.arange(block_tables.shape[1], device=query.device)[None, :] < torch.tensor(
        blocks_per_seq, device=query.device
    )[:, None]  # [S, max_blocks]
    flat_block_ids = block_tables[in_use].long()
    keys = k_cache.index_select(0, flat_block_ids).view(-1, num_kv_heads, head_dim)  # [sum_blocks * bs, KVH, D]
    values = v_cache.index_select(0, flat_block_ids).view(-1, num_kv_heads, head_dim)
    q = query.reshape(num_seqs, num_kv_heads, group_size, head_dim).float()  # [S, KVH, G, D]
    out = torch.empty(num_seqs, num_kv_heads, group_size, head_dim, dtype=torch.float32, device=query.device)
    start = 0
    for seq, context_len in enumerate(context_list):
        # Only the first context_len slots are read: stale values in the tail of
        # the last block never reach the output.
        k = keys[start : start + context_len].transpose(0, 1).float()  # [KVH, L, D]
        v = values[start : start + context_len].transpose(0, 1).float()
        scores = torch.matmul(q[seq], k.transpose(1, 2)) * scale  # [KVH, G, L]
        out[seq] = torch.matmul(torch.softmax(scores, dim=-1), v)  # [KVH, G, D]
        start += blocks_per_seq[seq] * block_size
    return out.view(num_seqs, num_heads, head_dim).to(query.dtype)


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
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    out = torch.empty_like(query)
    bounds = cu_seqlens_q.tolist()
    prefixes = prefix_lens.tolist()
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
        if prefix_len == 0:
            mask = None
            is_causal = query_len > 1
        else:
            query_positions = torch.arange(prefix_len, context_len, device=query.device)
            key_positions = torch.arange(context_len, device=query.device)
            mask = key_positions[None, :] <= query_positions[:, None]  # [Q, L]
            is_causal = False
        attended = F.scaled_dot_product_attention(
            q[None], keys[None], values[None], attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=True
        )  # [1, H, Q, D]
        out[start:end] = attended[0].transpose(0, 1)
    return out


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
