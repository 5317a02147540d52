"""BlockAllocator: pure bookkeeping over a fixed pool, checked against a plain model of its tables."""

import random

import pytest

from workers.scheduling.kv_cache_manager import BlockAllocator


def make_allocator(num_blocks: int = 16, block_size: int = 4) -> BlockAllocator:
    return BlockAllocator(num_blocks, block_size)


def snapshot(allocator: BlockAllocator, seq_ids) -> tuple[int, dict]:
    """Everything observable: free count and every known sequence's table."""
    tables = {seq_id: allocator.block_table(seq_id) for seq_id in seq_ids if allocator.has(seq_id)}
    return allocator.num_free_blocks, tables


def assert_consistent(allocator: BlockAllocator, tables: dict[str, list[int]]) -> None:
    reserved = sum(len(table) for table in tables.values())
    assert allocator.num_free_blocks + reserved == allocator.num_blocks
    assert allocator.num_reserved_blocks == reserved
    assert 0 <= allocator.num_free_blocks <= allocator.num_blocks
    owned = [block for table in tables.values() for block in table]
    assert len(owned) == len(set(owned)), "a block is in two tables"
    for seq_id, table in tables.items():
        assert allocator.block_table(seq_id) == table
    allocator.check_invariants()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_operations_keep_the_pool_consistent(seed):
    rng = random.Random(seed)
    allocator = make_allocator(num_blocks=16, block_size=4)
    tables: dict[str, list[int]] = {}  # what the allocator must report, kept independently
    tokens: dict[str, int] = {}
    outcomes = {"allocated": 0, "allocate_refused": 0, "grew": 0, "extend_refused": 0, "released": 0}
    next_id = 0
    for _ in range(400):
        op = rng.choice(["allocate", "allocate", "extend", "extend", "extend", "release"])
        if op == "allocate" or not tables:
            seq_id, next_id = f"s{next_id}", next_id + 1
            num_tokens = rng.randint(0, 30)
            before = snapshot(allocator, tables)
            result = allocator.allocate(seq_id, num_tokens)
            if result is None:
                assert allocator.blocks_for(num_tokens) > before[0]
                assert snapshot(allocator, tables) == before
                assert not allocator.has(seq_id)
                outcomes["allocate_refused"] += 1
            else:
                assert len(result) == allocator.blocks_for(num_tokens)
                assert allocator.num_reserved_tokens(seq_id) >= num_tokens
                tables[seq_id], tokens[seq_id] = result, num_tokens
                outcomes["allocated"] += 1
        elif op == "extend":
            seq_id = rng.choice(sorted(tables))
            num_tokens = max(0, tokens[seq_id] + rng.randint(-4, 20))
            before = snapshot(allocator, tables)
            added = allocator.extend(seq_id, num_tokens)
            if added is None:
                assert allocator.blocks_for(num_tokens) - len(tables[seq_id]) > before[0]
                assert snapshot(allocator, tables) == before
                outcomes["extend_refused"] += 1
            else:
                assert len(added) == max(0, allocator.blocks_for(num_tokens) - len(tables[seq_id]))
                # Growing appends: the blocks already holding tokens keep their place.
                tables[seq_id] = tables[seq_id] + added
                tokens[seq_id] = max(tokens[seq_id], num_tokens)
                assert allocator.num_reserved_tokens(seq_id) >= num_tokens
                outcomes["grew"] += bool(added)
        else:
            seq_id = rng.choice(sorted(tables))
            assert allocator.release(seq_id) == len(tables.pop(seq_id))
            del tokens[seq_id]
            assert not allocator.has(seq_id)
            outcomes["released"] += 1
        assert_consistent(allocator, tables)
    # The run must have exercised every path, refusals included.
    assert all(count > 0 for count in outcomes.values()), outcomes
    for seq_id in list(tables):
        allocator.release(seq_id)
    assert allocator.num_free_blocks == allocator.num_blocks
    assert allocator.num_reserved_blocks == 0
    allocator.check_invariants()


def test_allocate_refuses_without_change_when_short():
    allocator = make_allocator(num_blocks=4, block_size=4)
    assert allocator.allocate("a", 9) == [0, 1, 2]
    assert not allocator.can_allocate(5)
    assert allocator.allocate("b", 5) is None
    assert not allocator.has("b")
    assert allocator.num_free_blocks == 1
    assert allocator.can_allocate(4)
    assert allocator.allocate("b", 4) == [3]


def test_extend_refuses_without_change_when_short():
    allocator = make_allocator(num_blocks=4, block_size=4)
    allocator.allocate("a", 4)
    allocator.allocate("b", 8)
    assert allocator.extend("a", 12) is None  # needs 2 more, 1 free
    assert allocator.block_table("a") == [0]
    assert allocator.num_free_blocks == 1
    assert allocator.extend("a", 8) == [3]
    assert allocator.block_table("a") == [0, 3]


def test_extend_within_reservation_adds_nothing_and_never_shrinks():
    allocator = make_allocator(num_blocks=8, block_size=4)
    allocator.allocate("a", 6)
    assert allocator.extend("a", 8) == []
    assert allocator.extend("a", 1) == []
    assert allocator.block_table("a") == [0, 1]
    assert allocator.num_reserved_tokens("a") == 8


def test_extend_keeps_blocks_in_token_order_after_reuse():
    allocator = make_allocator(num_blocks=6, block_size=2)
    allocator.allocate("a", 2)
    allocator.allocate("b", 4)
    allocator.release("a")
    allocator.allocate("c", 2)
    first = allocator.block_table("b")
    added = allocator.extend("b", 10)
    assert allocator.block_table("b") == first + added
    assert len(added) == 3
    allocator.check_invariants()


def test_zero_token_allocation_holds_a_table_but_no_blocks():
    allocator = make_allocator(num_blocks=2, block_size=4)
    assert allocator.allocate("a", 0) == []
    assert allocator.has("a")
    assert allocator.num_free_blocks == 2
    assert allocator.extend("a", 1) == [0]


def test_bad_calls_raise():
    allocator = make_allocator()
    allocator.allocate("a", 4)
    with pytest.raises(ValueError, match="'a' already holds blocks"):
        allocator.allocate("a", 4)
    with pytest.raises(ValueError, match="num_tokens must be >= 0, got -1"):
        allocator.allocate("b", -1)
    assert not allocator.has("b")
    assert allocator.release("unknown") == 0
    allocator.check_invariants()


@pytest.mark.parametrize("num_blocks,block_size,match", [(0, 4, "num_blocks must be >= 1, got 0"), (4, 0, "block_size must be >= 1, got 0")])
def test_constructor_rejects_empty_geometry(num_blocks, block_size, match):
    with pytest.raises(ValueError, match=match):
        BlockAllocator(num_blocks, block_size)


@pytest.mark.parametrize("num_tokens,blocks", [(0, 0), (1, 1), (3, 1), (4, 1), (5, 2), (8, 2), (9, 3), (33, 9)])
def test_blocks_for_rounds_up(num_tokens, blocks):
    assert make_allocator(block_size=4).blocks_for(num_tokens) == blocks


@pytest.mark.parametrize("kv_cache_bytes,num_blocks", [(1024, 1), (1024 * 7 + 1023, 7), (1024 * 64, 64)])
def test_from_budget_floors_to_whole_blocks(kv_cache_bytes, num_blocks):
    allocator = BlockAllocator.from_budget(kv_cache_bytes, bytes_per_block=1024, block_size=4)
    assert allocator.num_blocks == num_blocks
    assert allocator.block_size == 4
    assert allocator.num_free_blocks == num_blocks


def test_from_budget_without_a_whole_block_names_the_minimum():
    with pytest.raises(ValueError, match=r"kv_cache_bytes=1023 holds no block of 1024 bytes \(4 tokens\).*at least 1024"):
        BlockAllocator.from_budget(1023, bytes_per_block=1024, block_size=4)


def test_check_invariants_catches_a_double_booked_block():
    allocator = make_allocator(num_blocks=4)
    allocator.allocate("a", 4)
    allocator.check_invariants()
    # Corrupt the private free list on purpose: the checker must not be vacuous.
    allocator._free_block_ids.append(allocator.block_table("a")[0])
    with pytest.raises(AssertionError):
        allocator.check_invariants()


def test_shrink_gives_back_the_tail_beyond_the_new_plan_and_keeps_committed_blocks():
    allocator = make_allocator(num_blocks=16, block_size=4)
    table = allocator.allocate("s", 40)  # 10 blocks
    assert allocator.shrink("s", 9) == 7  # 9 tokens need 3 blocks
    assert allocator.block_table("s") == table[:3] and allocator.num_free_blocks == 13
    assert allocator.shrink("s", 12) == 0  # already that small: nothing moves
    allocator.check_invariants()
    cached = BlockAllocator(16, 4, enable_prefix_caching=True)
    tokens = list(range(100, 116))  # 4 full blocks
    cached.allocate("c", 24)
    cached.commit("c", 16, lambda start, end: tokens[start:end])  # 4 blocks named in the prefix cache
    assert cached.shrink("c", 0) == 2  # the 4 named blocks stay, the 2 empty ones go
    assert len(cached.block_table("c")) == 4
    cached.check_invariants()
    with pytest.raises(ValueError, match="num_tokens must be >= 0"):
        cached.shrink("c", -1)
