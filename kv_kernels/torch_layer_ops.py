"""A decoder layer's elementwise ops in plain torch, any device: the fast path's ops where no C++ kernels run.

The same four ops as `kv_kernels.cpu_kernels` (`rms_norm`, `fused_add_rms_norm`,
`rotary_embedding`, `silu_and_mul`), with the same signatures and in-place
contracts, written as the very torch ops Hugging Face's Llama modules run, in
the same order, so they round where HF rounds. On CUDA they let `FastDecoder` skip
HF's module stack (measured on an H100, LLaMA-7B shape, bf16: the HF stack took
24 ms a step at one sequence, nearly all of it host-side dispatch).
"""

import torch
import torch.nn.functional as F

__all__ = ["fused_add_rms_norm", "rms_norm", "rotary_embedding", "silu_and_mul"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of rows x [T, hidden] -> new [T, hidden], float32 inside. A weight in x's dtype: LlamaRMSNorm's
    rounding (to x's dtype, then times the weight); a float32 weight (Gemma's 1 + w): times the weight, then
    rounded once."""
    rows = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)  # [T, hidden] float32, HF's arithmetic in one op
    if weight.dtype == torch.float32:
        return (rows * weight).to(x.dtype)
    return weight * rows.to(x.dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place: residual = residual + x, then x = rms_norm(residual). Both [T, hidden]."""
    residual.add_(x)
    x.copy_(rms_norm(residual, weight, eps))


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin: torch.Tensor,
                     head_dim: int) -> None:
    """In place rotate-half rotary on query [T, H*D] and key [T, KVH*D] (row-strided views are fine);
    cos_sin [max_pos, D] float32, cos in the first half, sin in the second (values already rounded to the
    model's dtype, as HF's rotary module rounds them)."""
    half = head_dim // 2
    table = cos_sin.index_select(0, positions).to(query.dtype)  # [T, D]
    cos, sin = table[:, None, :half], table[:, None, half:]  # [T, 1, D/2] each
    rows = _adjacent(query, key)
    for part in (query, key) if rows is None else (rows,):
        heads = part.view(part.shape[0], -1, head_dim)  # [T, heads, D], a view of the caller's storage
        first, second = heads[..., :half], heads[..., half:]  # [T, heads, D/2] each
        # HF: x * cos + rotate_half(x) * sin, with rotate_half(x) = [-second, first]
        heads.copy_(torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1))


def _adjacent(query: torch.Tensor, key: torch.Tensor) -> torch.Tensor | None:
    """[q | k] as one view when key's columns directly follow query's in the same rows (the fast path's
    [q | k | v] projection): one rotation instead of two. None otherwise."""
    if (query.dim() != 2 or key.dim() != 2 or query.stride() != key.stride() or query.stride(1) != 1
            or query.shape[0] != key.shape[0]
            or key.data_ptr() != query.data_ptr() + query.shape[1] * query.element_size()):
        return None
    return query.as_strided((query.shape[0], query.shape[1] + key.shape[1]), query.stride())


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] of [T, 2I] -> silu(gate) * up [T, I]."""
    width = x.shape[1] // 2
    return F.silu(x[:, :width]) * x[:, width:]
