"""Block allocator over a KV-cache budget given in bytes.

Pure bookkeeping (no torch): it hands out block ids of the pool described in
`kv_kernels.layout`, keeps one block table per sequence and never promises more
blocks than the budget holds. Deciding *whom* to preempt when `allocate` or
`extend` returns None is the scheduler's job, not this module's.

    free list: [5, 4, 3]          block tables:  seq "a" -> [0, 1]
    reserved = sum of table sizes                seq "b" -> [2]
    num_free + reserved == num_blocks, always

With prefix caching (`workers.scheduling.prefix_cache`), a block is held by a reference count: a new
sequence whose first full blocks are already cached shares them (`allocate(..., token_ids)`)
and its prefill starts after them (`num_cached_tokens`). Blocks whose KV is computed are
named as the engine reports progress (`commit`); when the last holder releases a named block
it stays cached but evictable, and counts as free. Only the blocks a sequence does not share
are taken from the pool, so every count here (free, reserved) counts a shared block once.

    holders: block 7 -> 2 (seq "a" and seq "b" share it)    evictable (LRU): [9, 4]
    num_free = len(free list) + len(evictable)
"""

from collections.abc import Callable, Hashable

from workers.scheduling.prefix_cache import PrefixCache, block_hashes, chain_hash, salt_hash


class BlockAllocator:
    """Per-sequence block reservations over a fixed pool.

    Args:
        num_blocks: blocks in the pool.
        block_size: tokens per block.
        enable_prefix_caching: share and keep full blocks by their token-chain hash.
        cache_salt: names the model (and dtype) the KV belongs to; part of every block's hash.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False,
                 cache_salt: str = "") -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Popped from the end: recently freed blocks are reused first.
        self._free_block_ids: list[int] = list(range(num_blocks - 1, -1, -1))
        self._tables: dict[Hashable, list[int]] = {}
        self.enable_prefix_caching = enable_prefix_caching
        self.cache = PrefixCache()
        self.root_hash = salt_hash(cache_salt)
        self._holders = [0] * num_blocks  # sequences holding each block
        self._chains: dict[Hashable, list[int]] = {}  # hashes of a sequence's committed full blocks
        self._num_cached_tokens: dict[Hashable, int] = {}  # found in the cache at allocation

    @property
    def num_shared_holdings(self) -> int:
        """Block holdings beyond the first of each block: what counting per sequence overstates."""
        return sum(len(table) for table in self._tables.values()) - self.num_reserved_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Named blocks (held or evictable)."""
        return len(self.cache)

    @classmethod
    def from_budget(cls, kv_cache_bytes: int, bytes_per_block: int, block_size: int,
                    enable_prefix_caching: bool = False, cache_salt: str = "") -> "BlockAllocator":
        """Size the pool from a byte budget; raise if not even one block fits."""
        num_blocks = kv_cache_bytes // bytes_per_block
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_bytes={kv_cache_bytes} holds no block of {bytes_per_block} bytes "
                f"({block_size} tokens); raise the budget to at least {bytes_per_block}"
            )
        return cls(num_blocks, block_size, enable_prefix_caching, cache_salt)

    @property
    def num_free_blocks(self) -> int:
        """Blocks a sequence may take: free ones and cached ones nobody holds."""
        return len(self._free_block_ids) + self.cache.num_evictable

    @property
    def num_reserved_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

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
        return self.blocks_for(num_tokens) <= self.num_free_blocks

    def num_cached_tokens(self, seq_id: Hashable) -> int:
        """Tokens of the sequence's prefix found in the cache when it was allocated (0 without caching)."""
        return self._num_cached_tokens.get(seq_id, 0)

    def prefix_hashes(self, token_ids: list[int]) -> list[int]:
        """Chained hashes of the full blocks a sequence with these known tokens could share ([] without caching).

        All but its last token count: that one is always computed (its logits pick the next token).
        """
        if not self.enable_prefix_caching:
            return []
        return block_hashes(token_ids, self.block_size, self.root_hash, self._max_shared_blocks(len(token_ids)))

    def cached_prefix_blocks(self, prefix_hashes: list[int], held_only: bool = False) -> int:
        """Blocks of `prefix_hashes` (from `prefix_hashes`), from the first, the cache holds now; changes nothing.

        `held_only`: count only those some sequence holds (not the parked ones).
        """
        if not self.enable_prefix_caching:
            return 0
        blocks = self.cache.lookup(prefix_hashes)
        return sum(1 for block in blocks if self._holders[block] > 0) if held_only else len(blocks)

    def first_block_hash(self, token_ids: list[int]) -> int | None:
        """The hash of the first block a sequence with these known tokens could share (None: too short)."""
        if not self.enable_prefix_caching or self._max_shared_blocks(len(token_ids)) < 1:
            return None
        return block_hashes(token_ids, self.block_size, self.root_hash, 1)[0]

    def is_cached(self, block_hash: int) -> bool:
        return block_hash in self.cache

    def num_blocks_freed_by(self, seq_ids: list[Hashable]) -> int:
        """Blocks that releasing all of `seq_ids` would return (those no other sequence holds)."""
        counts: dict[int, int] = {}
        for seq_id in seq_ids:
            for block in self._tables.get(seq_id, ()):
                counts[block] = counts.get(block, 0) + 1
        return sum(1 for block, count in counts.items() if count == self._holders[block])

    def allocate(self, seq_id: Hashable, num_tokens: int, prefix_hashes: list[int] | None = None) -> list[int] | None:
        """Reserve blocks for a new sequence holding `num_tokens`; None if they are not free.

        `prefix_hashes`: `prefix_hashes(its known tokens)`. With prefix caching on, the longest
        cached run of those blocks is shared instead of taken, and `num_cached_tokens` says how
        many tokens it covers.
        """
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} already holds blocks")
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        needed = self.blocks_for(num_tokens)
        hashes, shared = [], []
        if self.enable_prefix_caching and prefix_hashes:
            hashes = prefix_hashes[:needed]
            shared = self.cache.lookup(hashes)
        num_parked_shared = sum(1 for block in shared if self._holders[block] == 0)
        if needed - len(shared) > self.num_free_blocks - num_parked_shared:
            return None
        for block in shared:
            if self._holders[block] == 0:
                self.cache.unpark(block)
            self._holders[block] += 1
        self._tables[seq_id] = shared + [self._take() for _ in range(needed - len(shared))]
        self._chains[seq_id] = hashes[:len(shared)]
        self._num_cached_tokens[seq_id] = len(shared) * self.block_size
        return list(self._tables[seq_id])

    def commit(self, seq_id: Hashable, num_computed_tokens: int,
               tokens_between: Callable[[int, int], list[int]]) -> int:
        """Name the sequence's blocks that are now full of computed KV; returns how many were named.

        `tokens_between(start, end)`: the sequence's tokens in that range (called only when a
        block filled since the last commit). A no-op without prefix caching.
        """
        if not self.enable_prefix_caching:
            return 0
        table, chain = self._tables[seq_id], self._chains.setdefault(seq_id, [])
        num_full = min(num_computed_tokens // self.block_size, len(table))
        if num_full <= len(chain):
            return 0
        start = len(chain)
        tokens = tokens_between(start * self.block_size, num_full * self.block_size)
        named = 0
        for index in range(start, num_full):
            offset = (index - start) * self.block_size
            block_hash = chain_hash(chain[-1] if chain else self.root_hash, tokens[offset:offset + self.block_size])
            chain.append(block_hash)
            named += self.cache.name(table[index], block_hash)
        return named

    def _max_shared_blocks(self, num_known_tokens: int) -> int:
        # The last known token is always computed (its logits pick the next token).
        return max(0, num_known_tokens - 1) // self.block_size

    def _take(self) -> int:
        """A block for one holder: a free one, else the least recently used cached one."""
        block = self._free_block_ids.pop() if self._free_block_ids else self.cache.evict()
        self._holders[block] = 1
        return block

    def _drop(self, block: int) -> None:
        """One holder lets go of a block: unheld, it is parked if named, else free."""
        self._holders[block] -= 1
        if self._holders[block] == 0:
            if self.cache.hash_of(block) is not None:
                self.cache.park(block)
            else:
                self._free_block_ids.append(block)

    def extend(self, seq_id: Hashable, num_tokens: int) -> list[int] | None:
        """Grow a reservation to hold `num_tokens` in total.

        Returns the newly added blocks ([] when it already fits), or None,
        changing nothing, when not enough blocks are free.
        """
        table = self._tables[seq_id]
        needed = self.blocks_for(num_tokens) - len(table)
        if needed <= 0:
            return []
        if needed > self.num_free_blocks:
            return None
        added = [self._take() for _ in range(needed)]
        table.extend(added)
        return added

    def shrink(self, seq_id: Hashable, num_tokens: int) -> int:
        """Give back the blocks of a reservation beyond what `num_tokens` need; returns how many.

        Blocks named in the prefix cache (full of committed KV) are always kept; callers pass
        at least the sequence's known tokens, so no computed KV is dropped.
        """
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        table = self._tables[seq_id]
        keep = max(self.blocks_for(num_tokens), len(self._chains.get(seq_id, ())))
        extra = table[keep:]
        del table[keep:]
        for block in reversed(extra):
            self._drop(block)
        return len(extra)

    def release(self, seq_id: Hashable) -> int:
        """Return all of a sequence's blocks to the pool; returns how many. Unknown ids free nothing."""
        table = self._tables.pop(seq_id, None)
        self._chains.pop(seq_id, None)
        self._num_cached_tokens.pop(seq_id, None)
        if table is None:
            return 0
        # Last block first: a chain's tail is the least likely to be shared again, so it is evicted first.
        for block in reversed(table):
            self._drop(block)
        return len(table)

    def check_invariants(self) -> None:
        """Raise AssertionError if a block is lost, double-booked, out of range or miscounted."""
        holders = [0] * self.num_blocks
        for table in self._tables.values():
            assert len(set(table)) == len(table), "a sequence holds one block twice"
            for block in table:
                holders[block] += 1
        assert holders == self._holders, "holder counts disagree with the block tables"
        unheld = [block for block in range(self.num_blocks) if holders[block] == 0]
        parked = [block for block in unheld if self.cache.is_parked(block)]
        assert sorted(parked + self._free_block_ids) == unheld, "an unheld block is lost or double-booked"
        assert all(self.cache.hash_of(block) is not None for block in parked), "a parked block has no name"
        assert all(self.cache.hash_of(block) is None for block in self._free_block_ids), "a free block is named"
