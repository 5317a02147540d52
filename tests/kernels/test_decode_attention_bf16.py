"""The CPU kernel's bf16 decodes (AVX512-BF16 dots straight from the cache) against the same attention in fp32.

The fp32 path is tested against the definition (sliding windows included) in test_kv_kernels.py; here the bf16
decodes of the engine's shapes must give what it gives on the same values, rounded once to bf16.
"""

import pytest
import torch

from kv_driver import blocks_for, random_cache, shuffled_block_tables
from kv_kernels import cpu_build, reference

cpu_build.load()  # a failed build fails these tests (no skip): the engine's CPU path needs it

LENS = [1, 15, 16, 17, 33, 100, 250]  # inside one chunk, on its edge, one past it, many chunks with tails


def _decode(query, k_cache, v_cache, tables, lens, window):
    out = torch.empty_like(query)
    starts = torch.arange(len(lens) + 1, dtype=torch.int32)
    torch.ops.s3_cpu.paged_attention(query, k_cache, v_cache, tables, starts, torch.tensor(lens, dtype=torch.int32),
                                     query.shape[-1] ** -0.5, window, out)
    return out


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(9, 3), (8, 2), (4, 4)], ids=["g3", "g4", "g1"])
@pytest.mark.parametrize("block_size", [5, 16])
@pytest.mark.parametrize("window", [0, 5, 16, 40])
def test_bf16_decodes_give_the_fp32_attention_of_the_same_values(head_dim, num_heads, num_kv_heads, block_size,
                                                                   window):
    num_blocks = sum(blocks_for(n, block_size) for n in LENS) + 2
    k_cache, v_cache = random_cache(num_blocks, block_size, num_kv_heads, head_dim, seed=head_dim + block_size,
                                    dtype=torch.bfloat16)
    tables = shuffled_block_tables(LENS, block_size, num_blocks, seed=num_heads).int()
    query = torch.randn(len(LENS), num_heads, head_dim, generator=torch.Generator().manual_seed(window)).bfloat16()
    got = _decode(query, k_cache, v_cache, tables, LENS, window)
    want = _decode(query.float(), k_cache.float(), v_cache.float(), tables, LENS, window)
    assert got.dtype == torch.bfloat16
    # fp32 sums in another order, then one rounding to bf16: within a bf16 step of the fp32 result
    torch.testing.assert_close(got.float(), want, atol=4e-3, rtol=2**-7)
    if window == 0:
        plain = reference.paged_decode_attention(query.float(), k_cache.float(), v_cache.float(), tables,
                                                 torch.tensor(LENS), head_dim**-0.5)
        torch.testing.assert_close(got.float(), plain, atol=4e-3, rtol=2**-7)


def test_a_padded_query_row_and_an_output_view_are_read_and_written_in_place():
    num_kv_heads, head_dim, block_size, lens = 3, 64, 16, [40, 3]
    k_cache, v_cache = random_cache(8, block_size, num_kv_heads, head_dim, seed=5, dtype=torch.bfloat16)
    tables = shuffled_block_tables(lens, block_size, 8, seed=5).int()
    wide = torch.randn(len(lens), 9, 2 * head_dim, generator=torch.Generator().manual_seed(5)).bfloat16()
    query = wide[:, :, head_dim:]  # [S, H, D], rows 2 * D apart
    out_wide = torch.zeros(len(lens), 9, 2 * head_dim, dtype=torch.bfloat16)
    out = out_wide[:, :, :head_dim]
    starts = torch.arange(len(lens) + 1, dtype=torch.int32)
    torch.ops.s3_cpu.paged_attention(query, k_cache, v_cache, tables, starts, torch.tensor(lens, dtype=torch.int32),
                                     0.125, 0, out)
    want = _decode(query.contiguous().float(), k_cache.float(), v_cache.float(), tables, lens, 0)
    torch.testing.assert_close(out.float(), want, atol=4e-3, rtol=2**-7)
    assert not out_wide[:, :, head_dim:].any()  # nothing written past the view
