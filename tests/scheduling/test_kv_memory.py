"""`kv_cache_memory`: parsed once, sized once the model is loaded, the same rules on the CPU and CUDA."""

import pytest

from workers.values.kv_memory import (AUTO_CPU_SHARE, AUTO_CUDA_SHARE, KvCacheMemory, kv_budget_bytes, kv_token_room,
                               parse_kv_cache_memory)

GIB = 1024**3


@pytest.mark.parametrize("value, expected", [
    ("auto", KvCacheMemory()), ("AUTO", KvCacheMemory()),
    ("0.5", KvCacheMemory(share=0.5)), (0.25, KvCacheMemory(share=0.25)), ("1", KvCacheMemory(share=1.0)),
    ("4GiB", KvCacheMemory(num_bytes=4 * GIB)), ("512 MiB", KvCacheMemory(num_bytes=512 * 1024**2)),
    ("2GB", KvCacheMemory(num_bytes=2 * 10**9)), ("1.5GiB", KvCacheMemory(num_bytes=3 * GIB // 2)),
    ("268435456", KvCacheMemory(num_bytes=268435456)), (268435456, KvCacheMemory(num_bytes=268435456)),
])
def test_sizes_shares_and_auto_are_read(value, expected):
    assert parse_kv_cache_memory(value) == expected


@pytest.mark.parametrize("value", ["", "-5", "0", "0.0", "1.5", "4 parsecs", "lots", True, None, [1]])
def test_anything_else_is_refused_naming_what_is_expected(value):
    with pytest.raises(ValueError, match="kv_cache_memory must be 'auto', a share of free memory in"):
        parse_kv_cache_memory(value)


def test_bytes_are_bytes_and_a_share_is_of_the_free_memory_on_any_device():
    for device in ("cpu", "cuda"):
        assert kv_budget_bytes(KvCacheMemory(num_bytes=1000), device, 10 * GIB, 100, 2048, 32) == 1000
        assert kv_budget_bytes(KvCacheMemory(share=0.5), device, 10 * GIB, 100, 2048, 32) == 5 * GIB


def test_auto_takes_most_of_a_gpu_and_a_bounded_room_on_the_cpu():
    auto = KvCacheMemory()
    assert kv_budget_bytes(auto, "cuda:0", 100 * GIB, 100, 2048, 32) == int(100 * GIB * AUTO_CUDA_SHARE)
    room = 32 * 2048 * 23040  # SmolLM2-135M in bf16: 23,040 KV bytes per token; 1.4 GiB
    assert kv_budget_bytes(auto, "cpu", 20 * GIB, 23040, 2048, 32) == room
    assert kv_budget_bytes(auto, "cpu", 4 * GIB, 23040, 2048, 32) == int(4 * GIB * AUTO_CPU_SHARE)  # a small box


def test_no_room_for_one_token_is_a_clear_error():
    with pytest.raises(ValueError, match="no room for one token's KV"):
        kv_budget_bytes(KvCacheMemory(share=0.1), "cuda", 50, 1000, 2048, 32)


def test_the_room_known_before_workers_start_is_a_size_or_the_cpus_share():
    assert kv_token_room(KvCacheMemory(num_bytes=23040 * 1000), on_cpu=False, free_bytes=0, bytes_per_token=23040) == 1000
    assert kv_token_room(KvCacheMemory(), on_cpu=True, free_bytes=20 * GIB,
                         bytes_per_token=23040) == int(20 * GIB * AUTO_CPU_SHARE) // 23040  # 93,206 tokens
    assert kv_token_room(KvCacheMemory(share=0.5), on_cpu=True, free_bytes=GIB, bytes_per_token=1024) == 2**19
    for memory in (KvCacheMemory(), KvCacheMemory(share=0.5)):  # a GPU's free memory is measured on the worker
        assert kv_token_room(memory, on_cpu=False, free_bytes=100 * GIB, bytes_per_token=1024) is None
