"""The KV kernels' launchers and the step metadata refuse bad arguments with the values shown (torch reference,
Triton through TRITON_INTERPRET=1 and the C++ CPU kernels alike)."""

import pytest
import torch

from kv_driver import random_cache
from kv_kernels import build_attention_metadata, cpu_build, cpu_kernels, reference, triton_kernels
from kv_kernels.layout import BlockPoolShape

cpu_build.load()  # a failed build fails these tests (no skip): the engine's CPU path needs it

IMPLS = pytest.mark.parametrize("impl", [reference, triton_kernels, cpu_kernels], ids=["reference", "triton", "cpu"])


def _check_cases():
    k_cache, v_cache = random_cache(4, 4, 2, 16, seed=0)
    tables, lens = torch.zeros(2, 3, dtype=torch.int32), torch.tensor([3, 5])
    query = torch.randn(2, 4, 16)
    key = torch.randn(2, 2, 16)
    cu, prefixes = torch.tensor([0, 1, 2]), torch.tensor([2, 4])
    return {
        "append_dtype": (lambda m: m.append_kv(key.double(), key, k_cache, v_cache, lens), "key must have dtype"),
        "append_ndim": (lambda m: m.append_kv(key[0], key, k_cache, v_cache, lens), "key must have 3 dims"),
        "decode_heads": (
            lambda m: m.paged_decode_attention(torch.randn(2, 3, 16), k_cache, v_cache, tables, lens, 1.0),
            "num_heads 3 is not a multiple of num_kv_heads 2",
        ),
        "decode_table_dtype": (
            lambda m: m.paged_decode_attention(query, k_cache, v_cache, tables.float(), lens, 1.0),
            "block_tables must have dtype",
        ),
        "decode_head_dim": (
            lambda m: m.paged_decode_attention(query[..., :8], k_cache, v_cache, tables, lens, 1.0),
            "query head_dim 8 != cache head_dim 16",
        ),
        "prefill_ndim": (
            lambda m: m.prefill_attention(query[0], k_cache, v_cache, cu, prefixes, tables, 1.0),
            "query must have 3 dims",
        ),
        "prefill_kv_heads": (
            lambda m: m.prefill_attention(query, k_cache, v_cache[:, :, :1], cu, prefixes, tables, 1.0),
            "k_cache shape .* != v_cache shape",
        ),
        "prefill_cu_seqlens_short": (
            lambda m: m.prefill_attention(query, k_cache, v_cache, torch.tensor([0, 1, 1]), prefixes, tables, 1.0),
            r"cu_seqlens_q must rise from 0 to num_tokens=2",
        ),
        "copy_out_of_range": (
            lambda m: m.copy_blocks(k_cache, v_cache, torch.tensor([1, 4]), torch.tensor([2, 3])),
            r"src_block_ids must lie in \[0, 4\)",
        ),
        "gather_negative": (lambda m: m.gather_blocks(k_cache, torch.tensor([-1])), "block_ids must lie in"),
        "scatter_shape": (
            lambda m: m.scatter_blocks(k_cache, torch.tensor([0, 1]), k_cache[:1].clone()),
            "blocks must be",
        ),
    }


@IMPLS
@pytest.mark.parametrize("case", list(_check_cases()))
def test_launchers_reject_bad_arguments(impl, case):
    call, message = _check_cases()[case]
    with pytest.raises(ValueError, match=message):
        call(impl)


@pytest.mark.parametrize("change, message", [
    (lambda q, s, t, sl: (q, s, [[99]] + t[1:], sl), r"block ids must lie in \[0, 8\)"),
    (lambda q, s, t, sl: (q, [s[0] + 8] + s[1:], t, sl), "1 blocks cannot hold"),
    (lambda q, s, t, sl: ([1, 3], [4, 6], t, sl + [0, 0]), "must decode one token"),
    (lambda q, s, t, sl: (q, s, t, sl[:-1]), "slots for"),
])
def test_step_metadata_is_validated_once_with_the_values_shown(change, message):
    pool = BlockPoolShape(1, 8, 4, 1, 16, torch.float32)
    query_lens, seq_lens, tables, slots = [3, 1], [3, 5], [[2], [0, 1]], [8, 9, 10, 4]
    query_lens, seq_lens, tables, slots = change(query_lens, seq_lens, tables, slots)
    with pytest.raises(ValueError, match=message):
        build_attention_metadata(query_lens, seq_lens, tables, slots, 1, pool, "cpu")
