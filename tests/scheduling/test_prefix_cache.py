"""Prefix caching in the block allocator (pure: no torch): naming, sharing, keeping, evicting, never leaking."""

import random

import pytest

from workers.scheduling.kv_cache_manager import BlockAllocator
from workers.scheduling.prefix_cache import PrefixCache, block_hashes, salt_hash

BS = 4  # tokens per block


def caching(num_blocks: int = 16) -> BlockAllocator:
    return BlockAllocator(num_blocks, BS, enable_prefix_caching=True, cache_salt="tiny:fp32")


def share(allocator: BlockAllocator, tokens: list[int]) -> list[int]:
    """What the scheduler passes to allocate: the block hashes the tokens could share."""
    return allocator.prefix_hashes(tokens)


def computed(allocator: BlockAllocator, seq_id: str, tokens: list[int]) -> None:
    """As the engine does after a step that computed every known token."""
    allocator.commit(seq_id, len(tokens), lambda start, end: tokens[start:end])


def test_block_hashes_are_chained_stable_and_salted():
    root = salt_hash("model-a")
    a = block_hashes(list(range(12)), BS, root)
    assert len(a) == 3 and a == block_hashes(list(range(12)), BS, root)  # deterministic
    assert block_hashes(list(range(13)), BS, root) == a  # a partial block has no name
    changed_first = block_hashes([99] + list(range(1, 12)), BS, root)
    assert all(x != y for x, y in zip(a, changed_first))  # a change early renames every later block
    assert block_hashes(list(range(12)), BS, salt_hash("model-b"))[0] != a[0]
    assert block_hashes(list(range(12)), BS, root, num_blocks=2) == a[:2]


def test_a_second_request_shares_the_computed_prefix_and_counts_it_once():
    allocator = caching()
    prefix = list(range(100, 112))  # 3 full blocks
    first = prefix + [1, 2]
    assert len(allocator.allocate("a", 20, share(allocator, first))) == 5 and allocator.num_cached_tokens("a") == 0
    computed(allocator, "a", first)
    second = prefix + [7, 8, 9]
    table = allocator.allocate("b", 20, share(allocator, second))
    assert table[:3] == allocator.block_table("a")[:3] and allocator.num_cached_tokens("b") == 12
    assert allocator.num_reserved_blocks == 5 + 2  # b took only the blocks it does not share
    assert allocator.num_shared_holdings == 3
    allocator.check_invariants()


def test_the_last_known_token_is_never_taken_from_the_cache():
    allocator = caching()
    tokens = list(range(8))  # exactly 2 full blocks
    allocator.allocate("a", 8, share(allocator, tokens))
    computed(allocator, "a", tokens)
    allocator.allocate("b", 8, share(allocator, tokens))
    assert allocator.num_cached_tokens("b") == 4  # the second block is computed again (its logits)


def test_shared_blocks_survive_the_first_holder_and_stay_cached_after_the_last():
    allocator = caching(num_blocks=8)
    tokens = list(range(9))
    allocator.allocate("a", 9, share(allocator, tokens))
    computed(allocator, "a", tokens)
    allocator.allocate("b", 9, share(allocator, tokens))
    shared = allocator.block_table("a")[:2]
    allocator.release("a")  # abort or preemption of the first holder
    assert allocator.block_table("b")[:2] == shared
    allocator.release("b")
    assert allocator.num_free_blocks == 8 and allocator.num_cached_blocks == 2  # free, but still named
    allocator.allocate("c", 9, share(allocator, tokens))
    assert allocator.block_table("c")[:2] == shared and allocator.num_cached_tokens("c") == 8
    allocator.check_invariants()


def test_cached_blocks_are_evicted_least_recently_used_and_only_when_needed():
    allocator = caching(num_blocks=6)
    for seq_id, base in (("old", 0), ("new", 50)):
        tokens = list(range(base, base + 9))
        allocator.allocate(seq_id, 9, share(allocator, tokens))
        computed(allocator, seq_id, tokens)
        allocator.release(seq_id)
    assert allocator.num_cached_blocks == 4 and allocator.num_free_blocks == 6
    allocator.allocate("x", 8)  # 2 truly free blocks exist (each release freed its partial third block)
    assert allocator.num_cached_blocks == 4
    allocator.allocate("y", 4)  # now one cached block must go: the oldest, old's tail
    assert allocator.cached_prefix_blocks(share(allocator, list(range(9)))) == 1
    assert allocator.cached_prefix_blocks(share(allocator, list(range(50, 59)))) == 2
    allocator.check_invariants()


def test_a_request_that_does_not_fit_changes_nothing():
    allocator = caching(num_blocks=4)
    tokens = list(range(9))
    allocator.allocate("a", 9, share(allocator, tokens))
    computed(allocator, "a", tokens)
    allocator.release("a")
    allocator.allocate("b", 4)
    assert allocator.allocate("c", 40, share(allocator, tokens)) is None
    assert not allocator.has("c") and allocator.num_free_blocks == 3 and allocator.num_cached_blocks == 2
    allocator.check_invariants()


def test_without_prefix_caching_nothing_is_shared_or_kept():
    allocator = BlockAllocator(8, BS)
    tokens = list(range(9))
    allocator.allocate("a", 9, share(allocator, tokens))
    computed(allocator, "a", tokens)
    allocator.allocate("b", 9, share(allocator, tokens))
    assert allocator.num_cached_tokens("b") == 0 and allocator.num_reserved_blocks == 6
    allocator.release("a")
    allocator.release("b")
    assert allocator.num_cached_blocks == 0 and allocator.num_free_blocks == 8


@pytest.mark.parametrize("seed", range(6))
def test_random_allocate_grow_commit_release_never_leaks_or_frees_a_shared_block(seed):
    rng = random.Random(seed)
    allocator = caching(num_blocks=24)
    prefixes = [[rng.randrange(50) for _ in range(rng.choice((4, 8, 12)))] for _ in range(3)]
    live: dict[str, list[int]] = {}
    num_hits = 0
    for step in range(400):
        action = rng.random()
        if action < 0.4 or not live:
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 9))]
            seq_id = f"s{step}"
            if allocator.allocate(seq_id, len(tokens), share(allocator, tokens)) is not None:
                assert allocator.num_cached_tokens(seq_id) % BS == 0
                num_hits += allocator.num_cached_tokens(seq_id) > 0
                live[seq_id] = tokens
        elif action < 0.65:
            seq_id = rng.choice(list(live))
            grown = live[seq_id] + [rng.randrange(50) for _ in range(rng.randrange(1, 6))]
            if allocator.extend(seq_id, len(grown)) is not None:
                live[seq_id] = grown
        elif action < 0.85:
            seq_id = rng.choice(list(live))
            computed(allocator, seq_id, live[seq_id])
        else:
            seq_id = rng.choice(list(live))
            del live[seq_id]
            allocator.release(seq_id)  # finish, abort or preemption alike
        allocator.check_invariants()
        # A block some sequence holds is never handed out while held: holders count each table once.
        held = [block for seq_id in live for block in allocator.block_table(seq_id)]
        assert allocator.num_reserved_blocks == len(set(held))
    assert num_hits > 10  # the walk did share prefixes
    for seq_id in list(live):
        allocator.release(seq_id)
    allocator.check_invariants()
    assert allocator.num_free_blocks == allocator.num_blocks


def test_prefix_cache_names_a_hash_once():
    cache = PrefixCache()
    assert cache.name(3, 111) and not cache.name(4, 111) and not cache.name(3, 222)
    assert cache.lookup([111, 222]) == [3] and cache.hash_of(4) is None


def test_reported_hashes_are_the_most_recently_used_and_forget_evicted_blocks():
    cache = PrefixCache()
    for block, block_hash in enumerate((100, 101, 102)):
        cache.name(block, block_hash)
    assert cache.recent_hashes(2) == [101, 102] and cache.recent_hashes(0) == []
    cache.lookup([100])  # found again: most recent now
    assert cache.recent_hashes(3) == [101, 102, 100]
    cache.park(1)
    assert cache.evict() == 1 and cache.recent_hashes(10) == [102, 100]
