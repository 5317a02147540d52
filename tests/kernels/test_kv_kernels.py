"""Triton and C++ CPU KV-cache kernels vs the torch reference; Triton on CPU through TRITON_INTERPRET=1 (conftest).

Sizes stay small because the interpreter is slow: <= 6 sequences, <= 40 context tokens. The launchers' and the
step metadata's argument checks are in `test_kv_kernel_arguments.py`.
"""

import pytest
import torch

from kv_driver import blocks_for, cumulative, decode_lens, prefill_chunks, random_cache, shuffled_block_tables
from kv_kernels import build_attention_metadata, cpu_build, cpu_kernels, reference, triton_kernels
from kv_kernels.backend import CpuKVKernels, TorchKVKernels, TritonKVKernels
from kv_kernels.layout import BlockPoolShape

cpu_build.load()  # a failed build fails these tests (no skip): the engine's CPU path needs it

ATOL, RTOL = 1e-5, 1e-4
IMPLS = pytest.mark.parametrize("impl", [reference, triton_kernels, cpu_kernels], ids=["reference", "triton", "cpu"])
FAST_IMPLS = pytest.mark.parametrize("impl", [triton_kernels, cpu_kernels], ids=["triton", "cpu"])
HEADS = pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (8, 2)], ids=["g1", "g3", "g4"])
BLOCK_SIZES = pytest.mark.parametrize("block_size", [4, 8, 16])


# --------------------------------------------------------------------------- decode


@FAST_IMPLS
@HEADS
@BLOCK_SIZES
@pytest.mark.parametrize("head_dim", [64, 24])
def test_decode_matches_reference(impl, num_heads, num_kv_heads, block_size, head_dim):
    lens = decode_lens(block_size)
    num_blocks = sum(blocks_for(n, block_size) for n in lens) + 3
    k_cache, v_cache = random_cache(num_blocks, block_size, num_kv_heads, head_dim, seed=block_size + head_dim)
    tables = shuffled_block_tables(lens, block_size, num_blocks, seed=num_heads)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    query = torch.randn(len(lens), num_heads, head_dim, generator=torch.Generator().manual_seed(1))
    scale = head_dim**-0.5
    got = impl.paged_decode_attention(query, k_cache, v_cache, tables, context_lens, scale)
    want = reference.paged_decode_attention(query, k_cache, v_cache, tables, context_lens, scale)
    assert got.dtype == query.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


@FAST_IMPLS
def test_decode_strided_query_and_fp16(impl):
    block_size, num_kv_heads, head_dim, lens = 8, 2, 48, [5, 16, 23]
    k_cache, v_cache = random_cache(12, block_size, num_kv_heads, head_dim, seed=3, dtype=torch.float16)
    tables = shuffled_block_tables(lens, block_size, 12, seed=3)
    context_lens = torch.tensor(lens)
    wide = torch.randn(len(lens), 6, 2 * head_dim, generator=torch.Generator().manual_seed(3)).half()
    query = wide[:, :, head_dim:]  # [S, H, D] with non-packed strides
    got = impl.paged_decode_attention(query, k_cache, v_cache, tables, context_lens, 0.1)
    want = reference.paged_decode_attention(query, k_cache, v_cache, tables, context_lens, 0.1)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)


# --------------------------------------------------------------------------- prefill


@FAST_IMPLS
@HEADS
@BLOCK_SIZES
@pytest.mark.parametrize("head_dim", [64, 48])
def test_prefill_matches_reference(impl, num_heads, num_kv_heads, block_size, head_dim):
    chunk_lens, prefix_lens = prefill_chunks(block_size)
    context_lens = [p + c for p, c in zip(prefix_lens, chunk_lens)]
    num_blocks = sum(blocks_for(n, block_size) for n in context_lens) + 2
    k_cache, v_cache = random_cache(num_blocks, block_size, num_kv_heads, head_dim, seed=block_size * head_dim)
    tables = shuffled_block_tables(context_lens, block_size, num_blocks, seed=num_kv_heads)
    cu_seqlens = cumulative(chunk_lens)
    prefixes = torch.tensor(prefix_lens, dtype=torch.int32)
    query = torch.randn(sum(chunk_lens), num_heads, head_dim, generator=torch.Generator().manual_seed(2))
    scale = head_dim**-0.5
    got = impl.prefill_attention(query, k_cache, v_cache, cu_seqlens, prefixes, tables, scale)
    want = reference.prefill_attention(query, k_cache, v_cache, cu_seqlens, prefixes, tables, scale)
    assert got.dtype == query.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


def test_prefill_after_append_end_to_end():
    """Write prefixes and chunks through append_kv, then attend: Triton and CPU pipelines == reference pipeline."""
    block_size, num_heads, num_kv_heads, head_dim = 4, 9, 3, 24
    chunk_lens, prefix_lens = [3, 1, 6], [5, 8, 0]
    context_lens = [p + c for p, c in zip(prefix_lens, chunk_lens)]
    tables = shuffled_block_tables(context_lens, block_size, 10, seed=7)
    gen = torch.Generator().manual_seed(7)
    slots = torch.cat([
        tables[seq, torch.arange(n) // block_size].long() * block_size + torch.arange(n) % block_size
        for seq, n in enumerate(context_lens)
    ])  # slots of every cached token, sequence by sequence
    keys = torch.randn(len(slots), num_kv_heads, head_dim, generator=gen)
    values = torch.randn(len(slots), num_kv_heads, head_dim, generator=gen)
    query = torch.randn(sum(chunk_lens), num_heads, head_dim, generator=gen)
    outputs = []
    for impl in (triton_kernels, cpu_kernels, reference):
        k_cache, v_cache = torch.zeros(2, 10, block_size, num_kv_heads, head_dim)
        impl.append_kv(keys, values, k_cache, v_cache, slots)
        outputs.append(impl.prefill_attention(
            query, k_cache, v_cache, cumulative(chunk_lens), torch.tensor(prefix_lens), tables, 0.2
        ))
    torch.testing.assert_close(outputs[0], outputs[2], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(outputs[1], outputs[2], atol=ATOL, rtol=RTOL)


@IMPLS
def test_chunked_prefill_equals_whole_prefill(impl):
    """Prefilling 0..n in one chunk or as chunks [0, a) and [a, n) with prefix a gives the same rows."""
    block_size, num_kv_heads, head_dim, length, split = 4, 2, 24, 13, 6
    k_cache, v_cache = random_cache(6, block_size, num_kv_heads, head_dim, seed=11)
    table = shuffled_block_tables([length], block_size, 6, seed=11)
    query = torch.randn(length, 4, head_dim, generator=torch.Generator().manual_seed(11))
    whole = impl.prefill_attention(query, k_cache, v_cache, cumulative([length]), torch.tensor([0]), table, 0.3)
    first = impl.prefill_attention(query[:split], k_cache, v_cache, cumulative([split]), torch.tensor([0]), table, 0.3)
    rest = impl.prefill_attention(
        query[split:], k_cache, v_cache, cumulative([length - split]), torch.tensor([split]), table, 0.3
    )
    torch.testing.assert_close(torch.cat([first, rest]), whole, atol=ATOL, rtol=RTOL)


@IMPLS
@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (4, 1)])
def test_decode_equals_prefill_with_one_query_per_sequence(impl, num_heads, num_kv_heads):
    block_size, head_dim = 8, 24
    lens = decode_lens(block_size)
    k_cache, v_cache = random_cache(20, block_size, num_kv_heads, head_dim, seed=5)
    tables = shuffled_block_tables(lens, block_size, 20, seed=5)
    context_lens = torch.tensor(lens)
    query = torch.randn(len(lens), num_heads, head_dim, generator=torch.Generator().manual_seed(5))
    decode = impl.paged_decode_attention(query, k_cache, v_cache, tables, context_lens, 0.2)
    prefill = impl.prefill_attention(
        query, k_cache, v_cache, cumulative([1] * len(lens)), context_lens - 1, tables, 0.2
    )
    torch.testing.assert_close(decode, prefill, atol=ATOL, rtol=RTOL)


@FAST_IMPLS
@pytest.mark.parametrize("pad_value", [-1, 1000])
def test_never_reads_table_padding_or_slots_past_context(impl, pad_value):
    """Padding entries may be any value and stale slots past the context may hold nan/inf."""
    block_size, num_kv_heads, head_dim, lens = 4, 2, 24, [3, 8, 10]
    clean_k, clean_v = random_cache(12, block_size, num_kv_heads, head_dim, seed=9)
    clean_tables = shuffled_block_tables(lens, block_size, 12, seed=9, pad_value=0)
    tables = clean_tables.clone()
    poisoned_k, poisoned_v = clean_k.clone(), clean_v.clone()
    for seq, n in enumerate(lens):
        used = blocks_for(n, block_size)
        tables[seq, used:] = pad_value
        last_block = int(tables[seq, used - 1])
        poisoned_k[last_block, n % block_size or block_size:] = float("nan")
        poisoned_v[last_block, n % block_size or block_size:] = float("inf")
    used_blocks = {int(b) for seq, n in enumerate(lens) for b in tables[seq, : blocks_for(n, block_size)]}
    for block in set(range(12)) - used_blocks:
        poisoned_k[block], poisoned_v[block] = float("inf"), float("nan")
    query = torch.randn(len(lens), 4, head_dim, generator=torch.Generator().manual_seed(9))
    context_lens = torch.tensor(lens)
    got = impl.paged_decode_attention(query, poisoned_k, poisoned_v, tables, context_lens, 0.2)
    want = reference.paged_decode_attention(query, clean_k, clean_v, clean_tables, context_lens, 0.2)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    args = (cumulative([2, 1, 4]), torch.tensor([1, 7, 6]))
    chunk_query = torch.randn(7, 4, head_dim, generator=torch.Generator().manual_seed(10))
    got = impl.prefill_attention(chunk_query, poisoned_k, poisoned_v, *args, tables, 0.2)
    want = reference.prefill_attention(chunk_query, clean_k, clean_v, *args, clean_tables, 0.2)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


def test_reference_decode_ignores_stale_inf_past_context():
    k_cache, v_cache = random_cache(4, 4, 1, 16, seed=4)
    v_cache[1, 3] = float("inf")  # unused slot after a 7-token context
    tables = torch.tensor([[2, 1]], dtype=torch.int32)
    out = reference.paged_decode_attention(torch.randn(1, 2, 16), k_cache, v_cache, tables, torch.tensor([7]), 0.25)
    assert torch.isfinite(out).all()


# --------------------------------------------------------------------------- append and block moves


@FAST_IMPLS
@pytest.mark.parametrize("num_kv_heads,head_dim,block_size", [(3, 24, 4), (2, 64, 8), (1, 48, 16)])
def test_append_kv_matches_reference(impl, num_kv_heads, head_dim, block_size):
    num_blocks, num_tokens = 6, 11
    gen = torch.Generator().manual_seed(num_kv_heads)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]  # scattered, distinct
    packed = torch.randn(num_tokens, 2 * num_kv_heads + 1, head_dim, generator=gen)
    key, value = packed[:, :num_kv_heads], packed[:, num_kv_heads + 1:]  # strided views, like a fused qkv
    caches = [random_cache(num_blocks, block_size, num_kv_heads, head_dim, seed=0) for _ in range(2)]
    impl.append_kv(key, value, *caches[0], slots.int())
    reference.append_kv(key, value, *caches[1], slots)
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    assert torch.equal(caches[0][0].view(-1, num_kv_heads, head_dim)[slots], key)


def test_copy_blocks_matches_reference():
    src = torch.tensor([4, 0, 6, 3], dtype=torch.int32)
    dst = torch.tensor([1, 7, 6, 2], dtype=torch.int32)  # 6 -> 6 copies a block onto itself
    caches = [random_cache(8, 4, 3, 24, seed=1) for _ in range(2)]
    original_k = caches[0][0].clone()
    triton_kernels.copy_blocks(*caches[0], src, dst)
    reference.copy_blocks(*caches[1], src, dst)
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    assert torch.equal(caches[0][0][1], original_k[4]) and torch.equal(caches[0][0][5], original_k[5])


@pytest.mark.parametrize(
    "src,dst,message",
    [([0, 1], [1, 2], "also a source"), ([0, 3], [2, 2], "distinct")],
)
@pytest.mark.parametrize("impl", [reference, triton_kernels], ids=["reference", "triton"])
def test_copy_blocks_rejects_racing_copies(src, dst, message, impl):
    k_cache, v_cache = random_cache(4, 4, 1, 16, seed=2)
    before = k_cache.clone()
    with pytest.raises(ValueError, match=message):
        impl.copy_blocks(k_cache, v_cache, torch.tensor(src), torch.tensor(dst))
    assert torch.equal(k_cache, before)


@pytest.mark.parametrize("shape", [(7, 4, 3, 24), (6, 16, 2, 64)])
def test_gather_scatter_match_reference_and_round_trip(shape):
    cache, _ = random_cache(*shape, seed=shape[1])
    ids = torch.tensor([5, 0, 2], dtype=torch.int64)
    staged = triton_kernels.gather_blocks(cache, ids)
    assert staged.is_contiguous() and torch.equal(staged, reference.gather_blocks(cache, ids))
    new_ids = torch.tensor([1, 3, 4], dtype=torch.int32)
    expected = cache.clone()
    reference.scatter_blocks(expected, new_ids, staged)
    triton_kernels.scatter_blocks(cache, new_ids, staged)
    assert torch.equal(cache, expected)
    assert torch.equal(triton_kernels.gather_blocks(cache, new_ids), staged)


@pytest.mark.parametrize("backend_cls", [TorchKVKernels, TritonKVKernels, CpuKVKernels])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_swap_out_swap_in_restores_exact_bytes(backend_cls, dtype):
    backend = backend_cls()
    gen = torch.Generator().manual_seed(12)
    raw = torch.randint(0, 256, (6 * 4 * 2 * 24 * dtype.itemsize,), generator=gen, dtype=torch.uint8)
    cache = raw.view(dtype).view(6, 4, 2, 24)  # arbitrary bit patterns, nan payloads included
    original = cache.clone()
    ids = torch.tensor([4, 1, 5])
    host = torch.empty(3, 4, 2, 24, dtype=dtype)
    backend.swap_out(cache, ids, host)
    cache[ids] = 0  # the blocks get reused while swapped out
    backend.swap_in(cache, ids, host)
    assert torch.equal(cache.view(torch.uint8), original.view(torch.uint8))


# --------------------------------------------------------------------------- a whole step: attention()


def _step(block_size, num_kv_heads, head_dim, chunks, decodes, dtype, seed):
    """A mixed step: prefill chunks (length, prefix), then decodes (context incl. the new token).

    Returns the pool (prefixes already cached), metadata, and the step's q/k/v.
    """
    gen = torch.Generator().manual_seed(seed)
    query_lens = [length for length, _ in chunks] + [1] * len(decodes)
    seq_lens = [length + prefix for length, prefix in chunks] + list(decodes)
    num_blocks = sum(blocks_for(n, block_size) for n in seq_lens) + 2
    table_tensor = shuffled_block_tables(seq_lens, block_size, num_blocks, seed=seed)
    tables = [table_tensor[i, : blocks_for(n, block_size)].tolist() for i, n in enumerate(seq_lens)]
    k_cache, v_cache = random_cache(num_blocks, block_size, num_kv_heads, head_dim, seed=seed, dtype=dtype)
    slots = [tables[i][p // block_size] * block_size + p % block_size
             for i, (q, n) in enumerate(zip(query_lens, seq_lens)) for p in range(n - q, n)]
    pool = BlockPoolShape(1, num_blocks, block_size, num_kv_heads, head_dim, dtype)
    meta = build_attention_metadata(query_lens, seq_lens, tables, slots, len(chunks), pool, "cpu")
    num_tokens = sum(query_lens)
    query = torch.randn(num_tokens, 3 * num_kv_heads, head_dim, generator=gen).to(dtype)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    return k_cache, v_cache, meta, query, key, value


@pytest.mark.parametrize("backend_cls", [CpuKVKernels, TritonKVKernels])
def test_attention_step_matches_reference(backend_cls):
    chunks = [(9, 0), (5, 11), (1, 6)]  # (chunk length, cached prefix): whole prompt, continued chunk, 1-token chunk
    k_cache, v_cache, meta, query, key, value = _step(4, 2, 24, chunks, [1, 7, 13], torch.float32, seed=21)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want = reference.attention(query, key, value, want_k, want_v, meta, 0.2)
    got = backend_cls().attention(query, key, value, k_cache, v_cache, meta, 0.2)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def _windowed_dense(query, key_rows, value_rows, positions, context_lens, window, scale, group):
    """Plain attention of each query over its sequence's keys, the last `window` only: the definition, no pool."""
    out = torch.empty_like(query)
    for t, (pos, keys, values) in enumerate(zip(positions, key_rows, value_rows)):
        lo = max(0, pos + 1 - window)
        k = keys[lo:pos + 1].repeat_interleave(group, dim=1)  # [L, H, D]
        v = values[lo:pos + 1].repeat_interleave(group, dim=1)
        weights = torch.softmax(torch.einsum("hd,lhd->hl", query[t].float(), k.float()) * scale, dim=-1)
        out[t] = torch.einsum("hl,lhd->hd", weights, v.float()).to(query.dtype)
    return out


@pytest.mark.parametrize("backend_cls", [TorchKVKernels, CpuKVKernels, TritonKVKernels])
@pytest.mark.parametrize("window", [1, 5, 16])
def test_a_sliding_window_sees_only_the_last_keys(backend_cls, window):
    """Prefill from nothing, a continued chunk and decodes, each longer than the window somewhere."""
    chunks = [(19, 0), (6, 13), (1, 30)]  # (chunk length, cached prefix)
    decodes = [24, 3]  # context lengths of decoding sequences
    k_cache, v_cache, meta, query, key, value = _step(4, 2, 40, chunks, decodes, torch.float32, seed=23)
    got = backend_cls().attention(query, key, value, k_cache, v_cache, meta, 0.3, window)
    # the definition, reading each sequence's keys back from the pool in position order
    positions, key_rows, value_rows = [], [], []
    tables = meta.block_tables.tolist()
    for seq, (q_len, n) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
        slots = torch.tensor([tables[seq][p // 4] * 4 + p % 4 for p in range(n)])
        keys = k_cache.view(-1, *k_cache.shape[2:])[slots]
        values = v_cache.view(-1, *v_cache.shape[2:])[slots]
        for pos in range(n - q_len, n):
            positions.append(pos)
            key_rows.append(keys)
            value_rows.append(values)
    want = _windowed_dense(query, key_rows, value_rows, positions, None, window, 0.3, group=3)
    torch.testing.assert_close(got, want, atol=ATOL * 10, rtol=RTOL * 10)
    if window == 16:  # wider than some contexts: those rows are plain causal attention
        whole = reference.attention(query, key, value, k_cache.clone(), v_cache.clone(), meta, 0.3)
        torch.testing.assert_close(got[-1], whole[-1], atol=ATOL, rtol=RTOL)  # the decode at context 3


def test_cpu_attention_routes_long_bf16_chunks_to_sdpa_with_the_same_result():
    long_chunk = cpu_kernels.SDPA_MIN_CHUNK_TOKENS[torch.bfloat16]
    chunks = [(long_chunk + 3, 5), (12, 0)]  # the runner orders prefills longest first
    k_cache, v_cache, meta, query, key, value = _step(16, 3, 64, chunks, [40, 3], torch.bfloat16, seed=22)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want = reference.attention(query, key, value, want_k, want_v, meta, 0.125)
    got = cpu_kernels.attention(query, key, value, k_cache, v_cache, meta, 0.125)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)  # bf16 outputs
