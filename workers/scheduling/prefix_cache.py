"""Prefix caching: which pool blocks hold which full blocks of tokens, and which nobody uses now.

Pure bookkeeping (no torch). A *full* block of `block_size` tokens is named by a hash chained
over every token before it and the model (the salt), so equal hashes mean equal KV:

    salt --> h0 = H(salt, tokens[0:16]) --> h1 = H(h0, tokens[16:32]) --> ...

The hash is stable across processes (blake2b, 63 bits), so workers report the hashes they
hold (the most recently used first to go, bounded) and a router computes a request's own
with the same salt (`prefix_cache_salt`) to place it where its prefix is cached.

    by_hash:   hash  -> block id     (blocks whose KV is computed and named)
    evictable: block ids, least recently used first: cached blocks no sequence holds.
               They count as free; a new allocation takes a truly free block first and
               evicts the least recently used cached one only when none is left.
"""

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence


def chain_hash(previous: int, block_token_ids: Sequence[int]) -> int:
    """The hash of one full block after the block hashed `previous` (a stable 63-bit integer)."""
    digest = hashlib.blake2b(previous.to_bytes(8, "little") + array("q", block_token_ids).tobytes(), digest_size=8)
    return int.from_bytes(digest.digest(), "little") >> 1


def prefix_cache_salt(model: str, dtype: str) -> str:
    """The salt a service's workers and routers share: the model setting and the dtype setting."""
    return f"{model}|{dtype}"


def salt_hash(salt: str) -> int:
    """The chain's root for one model (its name and dtype): blocks of different models never match."""
    return int.from_bytes(hashlib.blake2b(salt.encode(), digest_size=8).digest(), "little") >> 1


def block_hashes(token_ids: Sequence[int], block_size: int, root: int, num_blocks: int | None = None) -> list[int]:
    """Chained hashes of the first `num_blocks` full blocks of `token_ids` (every full block when None)."""
    count = len(token_ids) // block_size if num_blocks is None else min(num_blocks, len(token_ids) // block_size)
    hashes, previous = [], root
    for index in range(count):
        previous = chain_hash(previous, token_ids[index * block_size:(index + 1) * block_size])
        hashes.append(previous)
    return hashes


class PrefixCache:
    """Named blocks and the least-recently-used order of the unused ones (see the module docstring)."""

    def __init__(self) -> None:
        self._block_of: dict[int, int] = {}  # hash -> block id
        self._hash_of: dict[int, int] = {}  # block id -> hash
        self._evictable: OrderedDict[int, None] = OrderedDict()  # block ids, oldest first
        self._recent: OrderedDict[int, None] = OrderedDict()  # hashes, least recently named or found first

    def __len__(self) -> int:
        return len(self._block_of)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def recent_hashes(self, limit: int) -> list[int]:
        """The `limit` hashes most recently named or found (what a worker reports; most recent last)."""
        if limit <= 0:
            return []
        return list(self._recent)[-limit:]

    def lookup(self, hashes: Sequence[int]) -> list[int]:
        """Blocks of the longest run of `hashes`, from the first, that is cached."""
        blocks = []
        for block_hash in hashes:
            block = self._block_of.get(block_hash)
            if block is None:
                break
            blocks.append(block)
            self._recent.move_to_end(block_hash)
        return blocks

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._block_of

    def hash_of(self, block: int) -> int | None:
        return self._hash_of.get(block)

    def name(self, block: int, block_hash: int) -> bool:
        """Name a block whose KV is now computed; False (nothing changes) if the hash or block is named already."""
        if block_hash in self._block_of or block in self._hash_of:
            return False
        self._block_of[block_hash] = block
        self._hash_of[block] = block_hash
        self._recent[block_hash] = None
        return True

    def park(self, block: int) -> None:
        """A named block nobody holds any more: evictable, most recently used."""
        self._evictable[block] = None

    def unpark(self, block: int) -> None:
        """A parked block is held again."""
        del self._evictable[block]

    def is_parked(self, block: int) -> bool:
        return block in self._evictable

    def evict(self) -> int:
        """Forget the least recently used parked block and return it (for reuse); KeyError if none."""
        block, _ = self._evictable.popitem(last=False)
        block_hash = self._hash_of.pop(block)
        del self._block_of[block_hash]
        del self._recent[block_hash]
        return block
