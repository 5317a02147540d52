"""Triton kernels for the paged KV cache. Semantics: `kv_kernels.reference`.

Layout (`kv_kernels.layout`): k_cache and v_cache are contiguous
[num_blocks, block_size, num_kv_heads, head_dim]; token t of a sequence sits in
block block_table[t // block_size] at offset t % block_size. Each launcher runs
the matching `kv_kernels.checks` function, then launches exactly one kernel; the
engine calls `attention()` instead, which runs the unchecked launchers after the
step's metadata was validated once:

    kernel                  grid                                     one program handles
    _append_kv_kernel       (num_tokens,)                            K and V rows of one token, all kv heads
    _paged_decode_kernel    (num_seqs, num_kv_heads)                 the GROUP_SIZE query heads of one kv head
    _prefill_kernel         (num_seqs, num_kv_heads, query_tiles)    QUERY_TILE tokens x GROUP_SIZE heads of one seq
    _copy_blocks_kernel     (num_copies, chunks_per_block)           one chunk of one block, in K and in V
    _move_blocks_kernel     (num_selected, chunks_per_block)         one chunk of one block, cache <-> staging

Both attention kernels flatten (query token, head of the GQA group) pairs into
the rows of a [ROWS, HEAD_DIM_PAD] tile, sweep the context in tiles of
KEY_TILE positions (each position looks up its own block id, so the tile size
does not depend on block_size) and keep an online softmax in fp32. Sizes that
need not be powers of two (head_dim, group size, kv heads) are padded to one
and masked; tl.dot operands are padded to at least 16 per dim, the GPU minimum.
"""

import torch
import triton
import triton.language as tl

from kv_kernels import checks
from kv_kernels.attention_metadata import AttentionMetadata

MIN_DOT_DIM = 16  # smallest M/N/K tl.dot accepts on GPUs
PREFILL_ROWS = 64  # (token, head) rows per prefill program
COPY_CHUNK_ELEMENTS = 4096  # elements one copy program moves


def _pad(n: int) -> int:
    """Smallest power of two >= n, and at least MIN_DOT_DIM."""
    return max(MIN_DOT_DIM, triton.next_power_of_2(n))


# --------------------------------------------------------------------------- append


@triton.jit
def _append_kv_kernel(
    key, value, k_cache, v_cache, slot_mapping,
    stride_key_token, stride_key_head, stride_value_token, stride_value_head,
    NUM_KV_HEADS: tl.constexpr, KV_HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):
    token = tl.program_id(0)
    heads = tl.arange(0, KV_HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)  # [KVH, D]
    slot = tl.load(slot_mapping + token).to(tl.int64)
    mask = mask & ((heads[:, None] * 0 + slot) >= 0)  # a negative slot is padding: nothing is written
    cache_offsets = slot * (NUM_KV_HEADS * HEAD_DIM) + heads[:, None] * HEAD_DIM + dims[None, :]  # [KVH, D]
    k = tl.load(key + token * stride_key_token + heads[:, None] * stride_key_head + dims[None, :], mask=mask)
    v = tl.load(value + token * stride_value_token + heads[:, None] * stride_value_head + dims[None, :], mask=mask)
    tl.store(k_cache + cache_offsets, k, mask=mask)
    tl.store(v_cache + cache_offsets, v, mask=mask)


def append_kv(key, value, k_cache, v_cache, slot_mapping) -> None:
    """Write key/value [num_tokens, num_kv_heads, head_dim] into their slots. See reference.append_kv."""
    checks.check_append(key, value, k_cache, v_cache, slot_mapping)
    _append_kv(key, value, k_cache, v_cache, slot_mapping)


def _append_kv(key, value, k_cache, v_cache, slot_mapping) -> None:
    num_tokens = key.shape[0]
    _, _, num_kv_heads, head_dim = k_cache.shape
    if num_tokens == 0:
        return
    _append_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping.contiguous(),
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        NUM_KV_HEADS=num_kv_heads, KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
    )


# --------------------------------------------------------------------------- attention


@triton.jit
def _attend_key_tile(
    acc, m_i, l_i, q, query_pos, key_start, kv_len, table_row, k_cache, v_cache, kv_head, scale, window,
    BLOCK_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr, KEY_TILE: tl.constexpr,
):
    """Fold context positions key_start .. key_start + KEY_TILE - 1 into the online softmax.

    acc: [R, Dp] fp32 unnormalised output; m_i, l_i: [R] fp32 running max and sum;
    q: [R, Dp]; query_pos: [R] position of each row's query token, which sees keys
    at positions <= query_pos (and, with `window` > 0, > query_pos - window). Positions >= kv_len are
    neither read nor attended.
    """
    key_pos = key_start + tl.arange(0, KEY_TILE)  # [N]
    key_ok = key_pos < kv_len  # [N]
    block_ids = tl.load(table_row + key_pos // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)  # [N]
    slots = block_ids * BLOCK_SIZE + key_pos % BLOCK_SIZE  # [N]
    dims = tl.arange(0, HEAD_DIM_PAD)
    offsets = slots[:, None] * (NUM_KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM + dims[None, :]  # [N, Dp] elements
    kv_mask = key_ok[:, None] & (dims[None, :] < HEAD_DIM)
    k = tl.load(k_cache + offsets, mask=kv_mask, other=0.0)  # k: [N, Dp]
    v = tl.load(v_cache + offsets, mask=kv_mask, other=0.0)  # v: [N, Dp]
    scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [R, N] fp32
    visible = key_ok[None, :] & (key_pos[None, :] <= query_pos[:, None])  # [R, N]
    visible = visible & ((window <= 0) | (key_pos[None, :] > query_pos[:, None] - window))
    scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))  # [R]
    alpha = tl.exp(m_i - m_new)  # [R] rescales what was accumulated so far
    p = tl.exp(scores - m_new[:, None])  # [R, N]
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return acc, m_new, l_i


@triton.jit
def _paged_decode_kernel(
    out, query, k_cache, v_cache, block_tables, context_lens, scale, window,
    stride_query_seq, stride_query_head, stride_out_seq, stride_out_head, stride_table_seq,
    GROUP_SIZE: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, KEY_TILE: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    group = tl.arange(0, GROUP_PAD)  # [R] head within the GQA group
    dims = tl.arange(0, HEAD_DIM_PAD)
    heads = kv_head * GROUP_SIZE + group  # [R]
    io_mask = (group[:, None] < GROUP_SIZE) & (dims[None, :] < HEAD_DIM)  # [R, Dp]
    q_ptrs = query + seq * stride_query_seq + heads[:, None] * stride_query_head + dims[None, :]
    q = tl.load(q_ptrs, mask=io_mask, other=0.0)  # q: [R, Dp]
    context_len = tl.load(context_lens + seq)  # tokens, the query's own included
    query_pos = tl.zeros([GROUP_PAD], dtype=tl.int64) + context_len - 1  # [R]
    table_row = block_tables + seq * stride_table_seq
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)
    m_i = tl.full([GROUP_PAD], -1e30, dtype=tl.float32)  # finite, so exp(m_i - m_new) is never nan
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    for key_start in range(0, context_len, KEY_TILE):
        acc, m_i, l_i = _attend_key_tile(
            acc, m_i, l_i, q, query_pos, key_start, context_len, table_row, k_cache, v_cache, kv_head, scale, window,
            BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, HEAD_DIM_PAD, KEY_TILE,
        )
    result = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # [R, Dp]
    out_ptrs = out + seq * stride_out_seq + heads[:, None] * stride_out_head + dims[None, :]
    tl.store(out_ptrs, result.to(out.dtype.element_ty), mask=io_mask)


def paged_decode_attention(query, k_cache, v_cache, block_tables, context_lens, scale) -> torch.Tensor:
    """query [num_seqs, num_heads, head_dim] -> same shape. See reference.paged_decode_attention."""
    checks.check_decode(query, k_cache, v_cache, block_tables, context_lens)
    return _paged_decode_attention(query, k_cache, v_cache, block_tables, context_lens, scale)


def _paged_decode_attention(query, k_cache, v_cache, block_tables, context_lens, scale,
                            window: int = 0) -> torch.Tensor:
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group_size = num_heads // num_kv_heads
    out = torch.empty((num_seqs, num_heads, head_dim), dtype=query.dtype, device=query.device)
    if num_seqs == 0:
        return out
    _paged_decode_kernel[(num_seqs, num_kv_heads)](
        out, query, k_cache, v_cache, block_tables, context_lens.contiguous(), float(scale), int(window),
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        GROUP_SIZE=group_size, GROUP_PAD=_pad(group_size), BLOCK_SIZE=block_size, NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=_pad(head_dim), KEY_TILE=_pad(block_size),
    )
    return out


@triton.jit
def _prefill_kernel(
    out, query, k_cache, v_cache, cu_seqlens_q, prefix_lens, block_tables, scale, window,
    stride_query_token, stride_query_head, stride_out_token, stride_out_head, stride_table_seq,
    GROUP_SIZE: tl.constexpr, ROWS: tl.constexpr, QUERY_TILE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, KEY_TILE: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    first_token = tl.program_id(2) * QUERY_TILE  # index within the chunk
    chunk_start = tl.load(cu_seqlens_q + seq)  # packed index of the chunk's first token
    chunk_len = tl.load(cu_seqlens_q + seq + 1) - chunk_start
    if first_token >= chunk_len:
        return
    prefix_len = tl.load(prefix_lens + seq)
    rows = tl.arange(0, ROWS)
    token = first_token + rows // GROUP_SIZE  # [R] index within the chunk
    heads = kv_head * GROUP_SIZE + rows % GROUP_SIZE  # [R]
    row_ok = (rows < QUERY_TILE * GROUP_SIZE) & (token < chunk_len)  # [R]
    dims = tl.arange(0, HEAD_DIM_PAD)
    io_mask = row_ok[:, None] & (dims[None, :] < HEAD_DIM)  # [R, Dp]
    packed = (chunk_start + token).to(tl.int64)  # [R] row in query / out
    q_ptrs = query + packed[:, None] * stride_query_token + heads[:, None] * stride_query_head + dims[None, :]
    q = tl.load(q_ptrs, mask=io_mask, other=0.0)  # q: [R, Dp]
    query_pos = prefix_len + token  # [R] position in the sequence
    kv_len = prefix_len + tl.minimum(chunk_len, first_token + QUERY_TILE)  # context the tile's last token sees
    table_row = block_tables + seq * stride_table_seq
    acc = tl.zeros([ROWS, HEAD_DIM_PAD], dtype=tl.float32)
    m_i = tl.full([ROWS], -1e30, dtype=tl.float32)  # finite, so exp(m_i - m_new) is never nan
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    for key_start in range(0, kv_len, KEY_TILE):
        acc, m_i, l_i = _attend_key_tile(
            acc, m_i, l_i, q, query_pos, key_start, kv_len, table_row, k_cache, v_cache, kv_head, scale, window,
            BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, HEAD_DIM_PAD, KEY_TILE,
        )
    result = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # [R, Dp]
    out_ptrs = out + packed[:, None] * stride_out_token + heads[:, None] * stride_out_head + dims[None, :]
    tl.store(out_ptrs, result.to(out.dtype.element_ty), mask=io_mask)


def prefill_attention(query, k_cache, v_cache, cu_seqlens_q, prefix_lens, block_tables, scale) -> torch.Tensor:
    """Ragged causal attention over cache. See reference.prefill_attention.

    Syncs with the host once, to size the grid by the longest chunk (`attention()` does not).
    """
    checks.check_prefill(query, k_cache, v_cache, cu_seqlens_q, prefix_lens, block_tables)
    max_chunk_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max()) if prefix_lens.shape[0] else 0
    return _prefill_attention(query, k_cache, v_cache, cu_seqlens_q, prefix_lens, block_tables, scale, max_chunk_len)


def _prefill_attention(query, k_cache, v_cache, cu_seqlens_q, prefix_lens, block_tables, scale,
                       max_chunk_len: int, window: int = 0) -> torch.Tensor:
    """`max_chunk_len` sizes the grid; the engine knows it on the host (no sync)."""
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group_size = num_heads // num_kv_heads
    num_seqs = prefix_lens.shape[0]
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=query.dtype, device=query.device)
    if num_tokens == 0 or max_chunk_len <= 0:
        return out
    rows = max(PREFILL_ROWS, triton.next_power_of_2(group_size))
    query_tile = rows // group_size  # tokens per program
    grid = (num_seqs, num_kv_heads, triton.cdiv(max_chunk_len, query_tile))
    _prefill_kernel[grid](
        out, query, k_cache, v_cache, cu_seqlens_q.contiguous(), prefix_lens.contiguous(), block_tables,
        float(scale), int(window), query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), GROUP_SIZE=group_size, ROWS=rows, QUERY_TILE=query_tile, BLOCK_SIZE=block_size,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=_pad(head_dim), KEY_TILE=_pad(block_size),
    )
    return out


def attention(query, key, value, k_cache, v_cache, meta: AttentionMetadata, scale: float,
              window: int = 0) -> torch.Tensor:
    """A whole step for one layer: append the step's K/V, then attend; no checks and no host sync.
    `window`: see reference.attention."""
    _append_kv(key, value, k_cache, v_cache, meta.slot_mapping)
    num_prefill = meta.num_prefill_tokens
    parts = []
    if meta.num_prefills:
        parts.append(_prefill_attention(
            query[:num_prefill], k_cache, v_cache, meta.prefill_cu_seqlens, meta.prefill_prefix_lens,
            meta.prefill_block_tables, scale, max(meta.query_lens_host[: meta.num_prefills]), window,
        ))
    if meta.num_seqs > meta.num_prefills:
        parts.append(_paged_decode_attention(query[num_prefill:], k_cache, v_cache, meta.decode_block_tables,
                                             meta.decode_context_lens, scale, window))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


# --------------------------------------------------------------------------- whole-block moves


@triton.jit
def _copy_blocks_kernel(k_cache, v_cache, src_block_ids, dst_block_ids, BLOCK_NUMEL: tl.constexpr,
                        CHUNK: tl.constexpr):
    copy = tl.program_id(0)
    offsets = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)  # [CHUNK] elements within a block
    mask = offsets < BLOCK_NUMEL
    src = tl.load(src_block_ids + copy).to(tl.int64) * BLOCK_NUMEL + offsets
    dst = tl.load(dst_block_ids + copy).to(tl.int64) * BLOCK_NUMEL + offsets
    tl.store(k_cache + dst, tl.load(k_cache + src, mask=mask), mask=mask)
    tl.store(v_cache + dst, tl.load(v_cache + src, mask=mask), mask=mask)


def copy_blocks(k_cache, v_cache, src_block_ids, dst_block_ids) -> None:
    """Copy whole blocks within one layer's K and V pools. See reference.copy_blocks."""
    checks.check_copy(k_cache, v_cache, src_block_ids, dst_block_ids)
    num_copies = src_block_ids.shape[0]
    if num_copies == 0:
        return
    block_numel = k_cache[0].numel()
    chunk = min(COPY_CHUNK_ELEMENTS, triton.next_power_of_2(block_numel))
    _copy_blocks_kernel[(num_copies, triton.cdiv(block_numel, chunk))](
        k_cache, v_cache, src_block_ids.contiguous(), dst_block_ids.contiguous(), BLOCK_NUMEL=block_numel, CHUNK=chunk,
    )


@triton.jit
def _move_blocks_kernel(cache, block_ids, staging, BLOCK_NUMEL: tl.constexpr, CHUNK: tl.constexpr,
                        TO_STAGING: tl.constexpr):
    index = tl.program_id(0)  # row of staging
    offsets = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)  # [CHUNK] elements within a block
    mask = offsets < BLOCK_NUMEL
    cache_ptrs = cache + tl.load(block_ids + index).to(tl.int64) * BLOCK_NUMEL + offsets
    staging_ptrs = staging + index.to(tl.int64) * BLOCK_NUMEL + offsets
    if TO_STAGING:
        tl.store(staging_ptrs, tl.load(cache_ptrs, mask=mask), mask=mask)
    else:
        tl.store(cache_ptrs, tl.load(staging_ptrs, mask=mask), mask=mask)


def _move_blocks(cache: torch.Tensor, block_ids: torch.Tensor, staging: torch.Tensor, to_staging: bool) -> None:
    block_numel = cache[0].numel() if cache.shape[0] else 0
    if block_ids.shape[0] == 0 or block_numel == 0:
        return
    chunk = min(COPY_CHUNK_ELEMENTS, triton.next_power_of_2(block_numel))
    _move_blocks_kernel[(block_ids.shape[0], triton.cdiv(block_numel, chunk))](
        cache, block_ids.contiguous(), staging, BLOCK_NUMEL=block_numel, CHUNK=chunk, TO_STAGING=to_staging,
    )


def gather_blocks(cache, block_ids) -> torch.Tensor:
    """Pack cache[block_ids] into a new contiguous [num_selected, ...] tensor. See reference.gather_blocks."""
    checks.check_gather(cache, block_ids)
    staging = torch.empty((block_ids.shape[0], *cache.shape[1:]), dtype=cache.dtype, device=cache.device)
    _move_blocks(cache, block_ids, staging, to_staging=True)
    return staging


def scatter_blocks(cache, block_ids, blocks) -> None:
    """Write blocks [num_selected, ...] into cache[block_ids] in place. See reference.scatter_blocks."""
    checks.check_scatter(cache, block_ids, blocks)
    _move_blocks(cache, block_ids, blocks, to_staging=False)
