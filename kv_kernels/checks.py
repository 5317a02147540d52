"""Argument checks shared by the torch reference and the Triton launchers.

Every public kernel entry point calls these before touching memory, so a wrong
shape, dtype or stride fails with a message naming the offending values instead
of reading out of bounds on the GPU.
"""

import torch

INDEX_DTYPES = (torch.int32, torch.int64)


def check_tensor(name: str, tensor: torch.Tensor, ndim: int, dtypes: tuple[torch.dtype, ...] | None = None) -> None:
    """Raise ValueError unless `tensor` is a tensor of `ndim` dims with one of `dtypes`."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(tensor.shape)}")
    if dtypes is not None and tensor.dtype not in dtypes:
        names = ", ".join(str(d) for d in dtypes)
        raise ValueError(f"{name} must have dtype in ({names}), got {tensor.dtype}")


def check_cache_pair(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """Check one layer's block pool and return (num_blocks, block_size, num_kv_heads, head_dim)."""
    check_tensor("k_cache", k_cache, 4)
    check_tensor("v_cache", v_cache, 4)
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache shape {tuple(k_cache.shape)} != v_cache shape {tuple(v_cache.shape)}")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache dtype {k_cache.dtype} != v_cache dtype {v_cache.dtype}")
    if k_cache.device != v_cache.device:
        raise ValueError(f"k_cache on {k_cache.device} but v_cache on {v_cache.device}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(
            f"caches must be contiguous, got strides {k_cache.stride()} and {v_cache.stride()}"
        )
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    return num_blocks, block_size, num_kv_heads, head_dim


def check_same_device(**tensors: torch.Tensor) -> None:
    """Raise ValueError unless every tensor lives on the same device."""
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"tensors must share one device, got {devices}")


def check_last_dim_contiguous(name: str, tensor: torch.Tensor) -> None:
    """Kernels index the last dim with unit stride."""
    if tensor.stride(-1) != 1:
        raise ValueError(f"{name} must have unit stride in its last dim, got strides {tensor.stride()}")


def check_heads(num_heads: int, num_kv_heads: int) -> int:
    """Return the GQA group size, or raise if query heads do not divide evenly."""
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    return num_heads // num_kv_heads


def check_append(key, value, k_cache, v_cache, slot_mapping) -> None:
    num_blocks, block_size, num_kv_heads, head_dim = check_cache_pair(k_cache, v_cache)
    check_tensor("key", key, 3, (k_cache.dtype,))
    check_tensor("value", value, 3, (k_cache.dtype,))
    check_tensor("slot_mapping", slot_mapping, 1, INDEX_DTYPES)
    expected = (key.shape[0], num_kv_heads, head_dim)
    if tuple(key.shape) != expected or tuple(value.shape) != expected:
        raise ValueError(
            f"key/value must be [num_tokens, num_kv_heads={num_kv_heads}, head_dim={head_dim}], "
            f"got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    if slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} slots for {key.shape[0]} tokens")
    check_last_dim_contiguous("key", key)
    check_last_dim_contiguous("value", value)
    check_same_device(key=key, value=value, k_cache=k_cache, slot_mapping=slot_mapping)


def check_decode(query, k_cache, v_cache, block_tables, context_lens) -> None:
    _, _, num_kv_heads, head_dim = check_cache_pair(k_cache, v_cache)
    check_tensor("query", query, 3, (k_cache.dtype,))
    check_tensor("block_tables", block_tables, 2, INDEX_DTYPES)
    check_tensor("context_lens", context_lens, 1, INDEX_DTYPES)
    num_seqs, num_heads, query_head_dim = query.shape
    if query_head_dim != head_dim:
        raise ValueError(f"query head_dim {query_head_dim} != cache head_dim {head_dim}")
    check_heads(num_heads, num_kv_heads)
    if block_tables.shape[0] != num_seqs or context_lens.shape[0] != num_seqs:
        raise ValueError(
            f"block_tables {tuple(block_tables.shape)} and context_lens {tuple(context_lens.shape)} "
            f"must have one row per sequence ({num_seqs})"
        )
    check_last_dim_contiguous("query", query)
    check_last_dim_contiguous("block_tables", block_tables)
    check_same_device(query=query, k_cache=k_cache, block_tables=block_tables, context_lens=context_lens)


def check_prefill(query, k_cache, v_cache, cu_seqlens_q, prefix_lens, block_tables) -> None:
    _, _, num_kv_heads, head_dim = check_cache_pair(k_cache, v_cache)
    check_tensor("query", query, 3, (k_cache.dtype,))
    check_tensor("cu_seqlens_q", cu_seqlens_q, 1, INDEX_DTYPES)
    check_tensor("prefix_lens", prefix_lens, 1, INDEX_DTYPES)
    check_tensor("block_tables", block_tables, 2, INDEX_DTYPES)
    num_tokens, num_heads, query_head_dim = query.shape
    if query_head_dim != head_dim:
        raise ValueError(f"query head_dim {query_head_dim} != cache head_dim {head_dim}")
    check_heads(num_heads, num_kv_heads)
    num_seqs = prefix_lens.shape[0]
    if cu_seqlens_q.shape[0] != num_seqs + 1 or block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"cu_seqlens_q {tuple(cu_seqlens_q.shape)} must have num_seqs+1={num_seqs + 1} entries and "
            f"block_tables {tuple(block_tables.shape)} num_seqs rows"
        )
    check_last_dim_contiguous("query", query)
    check_last_dim_contiguous("block_tables", block_tables)
    check_same_device(
        query=query, k_cache=k_cache, cu_seqlens_q=cu_seqlens_q, prefix_lens=prefix_lens, block_tables=block_tables
    )
    bounds = cu_seqlens_q.tolist()
    if bounds[0] != 0 or bounds[-1] != num_tokens or any(b > a for a, b in zip(bounds[1:], bounds)):
        raise ValueError(f"cu_seqlens_q must rise from 0 to num_tokens={num_tokens}, got {bounds}")


def check_block_ids(name: str, block_ids: torch.Tensor, num_blocks: int) -> None:
    check_tensor(name, block_ids, 1, INDEX_DTYPES)
    if block_ids.numel() and (int(block_ids.min()) < 0 or int(block_ids.max()) >= num_blocks):
        raise ValueError(
            f"{name} must lie in [0, {num_blocks}), got range "
            f"[{int(block_ids.min())}, {int(block_ids.max())}]"
        )


def check_copy(k_cache, v_cache, src_block_ids, dst_block_ids) -> None:
    num_blocks, *_ = check_cache_pair(k_cache, v_cache)
    check_block_ids("src_block_ids", src_block_ids, num_blocks)
    check_block_ids("dst_block_ids", dst_block_ids, num_blocks)
    if src_block_ids.shape != dst_block_ids.shape:
        raise ValueError(f"src_block_ids {tuple(src_block_ids.shape)} != dst_block_ids {tuple(dst_block_ids.shape)}")
    # Kernels run the copies in parallel: no block may be written twice, or
    # written while another copy reads it.
    if dst_block_ids.unique().numel() != dst_block_ids.numel():
        raise ValueError(f"dst_block_ids must be distinct, got {dst_block_ids.tolist()}")
    moved = src_block_ids != dst_block_ids  # a copy of a block onto itself is a no-op
    if bool(torch.isin(dst_block_ids[moved], src_block_ids).any()):
        raise ValueError(
            f"a destination block is also a source of another copy (src {src_block_ids.tolist()}, "
            f"dst {dst_block_ids.tolist()}); split the copy into independent batches"
        )


def check_gather(cache, block_ids) -> None:
    check_tensor("cache", cache, 4)
    if not cache.is_contiguous():
        raise ValueError(f"cache must be contiguous, got strides {cache.stride()}")
    check_block_ids("block_ids", block_ids, cache.shape[0])


def check_scatter(cache, block_ids, blocks) -> None:
    check_gather(cache, block_ids)
    check_tensor("blocks", blocks, 4, (cache.dtype,))
    expected = (block_ids.shape[0], *cache.shape[1:])
    if tuple(blocks.shape) != expected:
        raise ValueError(f"blocks must be {expected}, got {tuple(blocks.shape)}")
    if not blocks.is_contiguous():
        raise ValueError(f"blocks must be contiguous, got strides {blocks.stride()}")
