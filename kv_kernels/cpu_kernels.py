"""The C++ CPU kernels (`kv_kernels/csrc/`, `torch.ops.s3_cpu`, built by `kv_kernels.cpu_build`) behind the reference's signatures.

KV operations (same semantics and signatures as `kv_kernels.reference`, which the
tests compare them with):

    append_kv, paged_decode_attention, prefill_attention   checked, one op each
    attention(query, key, value, k_cache, v_cache, meta)    the engine's per-layer call, unchecked

and the fused elementwise ops of a Llama layer (`rms_norm`, `fused_add_rms_norm`,
`rotary_embedding`, `silu_and_mul`), which round where Hugging Face's bf16 modules
round. Call `kv_kernels.cpu_build.load()` once before using any of them.
"""

import torch

from kv_kernels import checks, reference
from kv_kernels.attention_metadata import AttentionMetadata
from kv_kernels.reference import copy_blocks, gather_blocks, scatter_blocks  # whole-block moves: plain copies

__all__ = ["append_kv", "attention", "copy_blocks", "fused_add_rms_norm", "gather_blocks", "paged_decode_attention",
           "prefill_attention", "rms_norm", "rotary_embedding", "row_argmax", "scatter_blocks", "silu_and_mul"]

# bf16 prefill chunks at least this long go to SDPA, which runs QK^T and PV as GEMMs (AMX):
# measured here, the per-query kernel wins below about 128 tokens and loses 3.5x at 512.
# In fp32 the kernel is never slower.
SDPA_MIN_CHUNK_TOKENS = {torch.bfloat16: 160, torch.float16: 160}


def _ops():
    return torch.ops.s3_cpu


def append_kv(key, value, k_cache, v_cache, slot_mapping) -> None:
    """See reference.append_kv."""
    checks.check_append(key, value, k_cache, v_cache, slot_mapping)
    _ops().append_kv(key, value, k_cache, v_cache, slot_mapping.long().contiguous())


def paged_decode_attention(query, k_cache, v_cache, block_tables, context_lens, scale) -> torch.Tensor:
    """See reference.paged_decode_attention."""
    checks.check_decode(query, k_cache, v_cache, block_tables, context_lens)
    num_seqs = query.shape[0]
    out = torch.empty_like(query)
    starts = torch.arange(num_seqs + 1, dtype=torch.int32)
    _ops().paged_attention(query, k_cache, v_cache, block_tables.int().contiguous(), starts,
                           context_lens.int().contiguous(), float(scale), 0, out)
    return out


def prefill_attention(query, k_cache, v_cache, cu_seqlens_q, prefix_lens, block_tables, scale) -> torch.Tensor:
    """See reference.prefill_attention."""
    checks.check_prefill(query, k_cache, v_cache, cu_seqlens_q, prefix_lens, block_tables)
    starts = cu_seqlens_q.int().contiguous()
    seq_lens = (prefix_lens.int() + (starts[1:] - starts[:-1])).contiguous()
    out = torch.empty_like(query)
    _ops().paged_attention(query, k_cache, v_cache, block_tables.int().contiguous(), starts, seq_lens, float(scale),
                           0, out)
    return out


def attention(query, key, value, k_cache, v_cache, meta: AttentionMetadata, scale: float,
              window: int = 0) -> torch.Tensor:
    """A whole step for one layer: append the step's K/V, then attend. query [T, H, D] -> [T, H, D].
    `window`: see reference.attention.

    Unchecked: the engine validated `meta` once for the step. Long bf16 prefill chunks,
    which the runner puts first, go to SDPA; everything else is one kernel call.
    """
    ops = _ops()
    ops.append_kv(key, value, k_cache, v_cache, meta.slot_mapping)
    out = torch.empty_like(query)
    min_sdpa = SDPA_MIN_CHUNK_TOKENS.get(query.dtype)
    num_long = 0
    if min_sdpa is not None and meta.max_query_len >= min_sdpa:
        while num_long < meta.num_prefills and meta.query_lens_host[num_long] >= min_sdpa:
            num_long += 1
    if num_long:
        starts = [0]
        for length in meta.query_lens_host[:num_long]:
            starts.append(starts[-1] + length)
        prefixes = [s - q for s, q in zip(meta.seq_lens_host[:num_long], meta.query_lens_host[:num_long])]
        out[: starts[-1]] = reference._prefill_attention(
            query[: starts[-1]], k_cache, v_cache, starts, prefixes, meta.block_tables[:num_long], scale, window)
    if num_long < meta.num_seqs:
        # query_start_loc keeps absolute token offsets, so the rest is a suffix of views
        ops.paged_attention(query, k_cache, v_cache, meta.block_tables[num_long:],
                            meta.query_start_loc[num_long:], meta.seq_lens[num_long:], float(scale), int(window),
                            out)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of rows x [T, hidden] -> new [T, hidden]: LlamaRMSNorm's rounding with a weight in x's dtype,
    Gemma3RMSNorm's with a float32 weight (1 + w)."""
    out = torch.empty_like(x)
    _ops().rms_norm(out, x, weight, eps)
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place: residual = residual + x, then x = rms_norm(residual). Both [T, hidden]."""
    _ops().fused_add_rms_norm(x, residual, weight, eps)


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin: torch.Tensor,
                     head_dim: int) -> None:
    """In place rotate-half rotary on query [T, H*D] and key [T, KVH*D]; cos_sin [max_pos, D] float32."""
    _ops().rotary_embedding(positions, query, key, cos_sin, head_dim)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] of [T, 2I] -> silu(gate) * up [T, I]."""
    out = torch.empty((x.shape[0], x.shape[1] // 2), dtype=x.dtype, device=x.device)
    _ops().silu_and_mul(out, x)
    return out


def row_argmax(logits: torch.Tensor) -> torch.Tensor:
    """See reference.row_argmax; several times faster on a large vocabulary."""
    return _ops().row_argmax(logits)


def amx_pack(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 weight [N, K] (K a multiple of 32) in the tile layout `s3_cpu.amx_linear` streams:
    [ceil(N / 64), K / 32, 4, 16, 32], zero columns past N (see kv_kernels/csrc/amx_linear.cpp)."""
    out_features, in_features = weight.shape
    if weight.dtype != torch.bfloat16 or in_features % 32:
        raise ValueError(f"amx_pack takes a bf16 weight with a multiple of 32 inputs, not {weight.dtype} "
                         f"[{out_features}, {in_features}]")
    padded = -out_features % 64
    w = torch.cat([weight, weight.new_zeros(padded, in_features)]) if padded else weight  # [N_pad, K]
    # n = (group, tile, column), k = (slice, row, pair) -> [group, slice, tile, row, column, pair]
    w = w.reshape(-1, 4, 16, in_features // 32, 16, 2).permute(0, 3, 1, 4, 2, 5)
    return w.contiguous().reshape(-1, in_features // 32, 4, 16, 32)


def bf16_weight_pack(weight: torch.Tensor) -> torch.Tensor:
    """A weight [N, K] (bf16 values; fp32 holding them is exact) in the panels `s3_cpu.bf16_weight_linear`
    streams: [ceil(N / 16), K, 16] bf16, a panel's 16 columns interleaved (column i, then i + 8) and zero
    columns past N (see kv_kernels/csrc/bf16_weight_linear.cpp)."""
    out_features, in_features = weight.shape
    w = weight.detach().to(torch.bfloat16)
    padded = -out_features % 16
    if padded:
        w = torch.cat([w, w.new_zeros(padded, in_features)])  # [N_pad, K]
    # n = (panel, half, lane) -> [panel, k, lane, half]
    return w.reshape(-1, 2, 8, in_features).permute(0, 3, 2, 1).contiguous().reshape(-1, in_features, 16)
