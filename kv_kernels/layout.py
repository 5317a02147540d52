"""Block-pool layout of the paged KV cache.

Each layer owns two tensors of identical shape, one for keys and one for values:

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]

A sequence's tokens live in fixed-size blocks scattered through the pool. Its
block table lists the blocks in token order, and a token's *slot* is its flat
index in the pool:

    slot = block_id * block_size + offset_in_block

    block table of seq A: [7, 2, 9]            block_size = 4
                                               pool (one layer, keys)
    token t of A -> block table[t // 4]        +---------+---------+---------+--
                  offset t % 4                 | block 0 | block 1 | block 2 | ..
                                               +---------+---------+---------+--
    A's tokens 4..7 sit in block 2,             block 2 = [tok4 tok5 tok6 tok7]
    A's token 8 sits in block 9, slot 36                  each tok = [kv_heads, head_dim]

Blocks are the unit of allocation, reservation, copy and swap; the last block
of a sequence may be partly filled. Slots are the unit of writing K/V.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class BlockPoolShape:
    """Geometry of the KV block pool of one model.

    Attributes:
        num_layers: decoder layers, each with its own K and V pool.
        num_blocks: blocks in each layer's pool.
        block_size: tokens per block.
        num_kv_heads: key/value heads (GQA groups).
        head_dim: features per head.
        dtype: element type of the cache.
    """

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block takes across all layers, keys and values."""
        element_bytes = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element_bytes

    def layer_shape(self) -> tuple[int, int, int, int]:
        return (self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim)


def allocate_block_pool(shape: BlockPoolShape, device: torch.device | str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Allocate zeroed (k_cache, v_cache) pairs, one per layer."""
    return [
        (
            torch.zeros(shape.layer_shape(), dtype=shape.dtype, device=device),
            torch.zeros(shape.layer_shape(), dtype=shape.dtype, device=device),
        )
        for _ in range(shape.num_layers)
    ]
