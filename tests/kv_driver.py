"""Paged-KV test inputs shared by the kernel tests: random pools, shuffled block tables, lengths on and off
block boundaries."""

import torch


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def random_cache(num_blocks, block_size, num_kv_heads, head_dim, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype)


def shuffled_block_tables(context_lens, block_size, num_blocks, seed, pad_value=None, extra_cols=2):
    """Non-contiguous shuffled block ids per sequence; entries past each sequence's blocks are padding
    (random valid ids unless `pad_value` is given)."""
    gen = torch.Generator().manual_seed(seed)
    needed = [blocks_for(n, block_size) for n in context_lens]
    assert sum(needed) <= num_blocks
    free = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(needed) + extra_cols
    if pad_value is None:
        table = torch.randint(0, num_blocks, (len(context_lens), width), generator=gen, dtype=torch.int32)
    else:
        table = torch.full((len(context_lens), width), pad_value, dtype=torch.int32)
    for seq, count in enumerate(needed):
        table[seq, :count] = torch.tensor([free.pop() for _ in range(count)], dtype=torch.int32)
    return table


def decode_lens(block_size: int) -> list[int]:
    """Lengths ending on a block boundary, one past it, one short of it, and a single token."""
    return [1, block_size, 2 * block_size, block_size + 1, min(40, 3 * block_size - 1)]


def prefill_chunks(block_size: int) -> tuple[list[int], list[int]]:
    """(chunk lengths, prefix lengths): length-1 chunks, no prefix, prefixes on and off block boundaries."""
    chunk_lens = [1, block_size, 7, 1, block_size + 3, 2]
    prefix_lens = [0, 0, block_size, block_size + 2, 3, 2 * block_size - 1]
    return chunk_lens, prefix_lens


def cumulative(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0)
