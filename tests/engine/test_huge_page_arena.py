"""`HugePageArena`: copies of the tensors it holds, aligned, packed into mappings of its chunk size."""

import torch

from workers.engine.huge_page_arena import ALIGN_BYTES, HUGE_PAGE_BYTES, HugePageArena


def test_held_copies_keep_values_dtype_and_shape_and_start_on_cache_lines():
    arena = HugePageArena(chunk_bytes=HUGE_PAGE_BYTES)
    originals = [torch.randn(3, 5), torch.arange(7, dtype=torch.int64), torch.randn(2, 3, 16).to(torch.bfloat16)]
    copies = [arena.hold(t) for t in originals]
    for original, copy in zip(originals, copies):
        assert copy.dtype == original.dtype and copy.shape == original.shape and copy.is_contiguous()
        assert torch.equal(copy, original) and copy.data_ptr() != original.data_ptr()
        assert copy.data_ptr() % ALIGN_BYTES == 0
    copies[0].zero_()  # copies do not overlap
    assert torch.equal(copies[1], originals[1]) and torch.equal(copies[2], originals[2])
    assert arena.bytes_mapped == HUGE_PAGE_BYTES  # all three in one mapping


def test_a_full_mapping_opens_the_next_and_a_tensor_larger_than_a_chunk_gets_its_own():
    arena = HugePageArena(chunk_bytes=HUGE_PAGE_BYTES)
    first = arena.hold(torch.ones(HUGE_PAGE_BYTES // 4 - 16))  # nearly fills the first mapping
    second = arena.hold(torch.full((64,), 2.0))  # does not fit the rest: a second mapping
    assert arena.bytes_mapped == 2 * HUGE_PAGE_BYTES
    large = arena.hold(torch.full((HUGE_PAGE_BYTES * 3 // 8,), 3.0))  # 1.5 chunks: 2 huge pages of its own
    assert arena.bytes_mapped == 4 * HUGE_PAGE_BYTES
    assert first.eq(1).all() and second.eq(2).all() and large.eq(3).all()
    for copy in (first, second, large):  # a mapping's start is a huge page boundary
        assert copy.data_ptr() % ALIGN_BYTES == 0
    assert second.data_ptr() % HUGE_PAGE_BYTES == 0 and large.data_ptr() % HUGE_PAGE_BYTES == 0
