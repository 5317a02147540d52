"""Block allocator over a KV-cache budget given in bytes.

Pure bookkeeping (no torch): it hands out block ids of the pool described in
`kv_kernels.layout`, keeps one block table per sequence and never promises more
blocks than the budget holds. Deciding *whom* to preempt when `allocate` or
`extend` returns None is the scheduler's job, not this module's.

    free list: [5, 4, 3]          block tables:  seq "a" -> [0, 1]
    reserved = sum of table sizes                seq "b" -> [2]
    num_free + reserved == num_blocks, always
"""

from collections.abc import Hashable


class BlockAllocator:
    """Per-sequence block reservations over a fixed pool.

    Args:
        num_blocks: blocks in the pool.
        block_size: tokens per block.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Popped from the end: recently freed blocks are reused first.
        self._free_block_ids: list[int] = list(range(num_blocks - 1, -1, -1))
        self._tables: dict[Hashable, list[int]] = {}

    @classmethod
    def from_budget(cls, kv_cache_bytes: int, bytes_per_block: int, block_size: int) -> "BlockAllocator":
        """Size the pool from a byte budget; raise if not even one block fits."""
        num_blocks = kv_cache_bytes // bytes_per_block
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_bytes={kv_cache_bytes} holds no block of {bytes_per_block} bytes "
                f"({block_size} tokens); raise the budget to at least {bytes_per_block}"
            )
        return cls(num_blocks, block_size)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_block_ids)

    @property
    def num_reserved_blocks(self) -> int:
        return self.num_blocks - len(self._free_block_ids)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def has(self, seq_id: Hashable) -> bool:
        return seq_id in self._tables

    def block_table(self, seq_id: Hashable) -> list[int]:
        """The sequence's blocks in token order (a copy)."""
        return list(self._tables[seq_id])

    def num_reserved_tokens(self, seq_id: Hashable) -> int:
        """Tokens the sequence can hold without growing."""
        return len(self._tables[seq_id]) * self.block_size

    def can_allocate(self, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) <= len(self._free_block_ids)

    def allocate(self, seq_id: Hashable, num_tokens: int) -> list[int] | None:
        """Reserve blocks for a new sequence holding `num_tokens`; None if they are not free."""
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} already holds blocks")
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        needed = self.blocks_for(num_tokens)
        if needed > len(self._free_block_ids):
            return None
        self._tables[seq_id] = [self._free_block_ids.pop() for _ in range(needed)]
        return list(self._tables[seq_id])

    def extend(self, seq_id: Hashable, num_tokens: int) -> list[int] | None:
        """Grow a reservation to hold `num_tokens` in total.

        Returns the newly added blocks ([] when it already fits), or None,
        changing nothing, when not enough blocks are free.
        """
        table = self._tables[seq_id]
        needed = self.blocks_for(num_tokens) - len(table)
        if needed <= 0:
            return []
        if needed > len(self._free_block_ids):
            return None
        added = [self._free_block_ids.pop() for _ in range(needed)]
        table.extend(added)
        return added

    def release(self, seq_id: Hashable) -> int:
        """Return all of a sequence's blocks to the pool; returns how many. Unknown ids free nothing."""
        table = self._tables.pop(seq_id, None)
        if table is None:
            return 0
        self._free_block_ids.extend(reversed(table))
        return len(table)

    def check_invariants(self) -> None:
        """Raise AssertionError if a block is lost, double-booked or out of range."""
        owned = [block for table in self._tables.values() for block in table]
        every = owned + self._free_block_ids
        assert len(every) == self.num_blocks, f"{len(every)} blocks accounted for, pool has {self.num_blocks}"
        assert sorted(every) == list(range(self.num_blocks)), "a block is double-booked or out of range"
