"""Kernel backends: one interface, a torch reference and a Triton implementation.

The engine asks `backend_for_device(device)` once and calls the backend's
methods; tests build both and compare them.
"""

import abc

import torch

from kv_kernels import reference


class KVKernelBackend(abc.ABC):
    """The KV-cache operations the engine needs. Signatures: see `kv_kernels.reference`."""

    name: str = "abstract"

    @abc.abstractmethod
    def append_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None: ...

    @abc.abstractmethod
    def paged_decode_attention(self, query, k_cache, v_cache, block_tables, context_lens, scale) -> torch.Tensor: ...

    @abc.abstractmethod
    def prefill_attention(
        self, query, k_cache, v_cache, cu_seqlens_q, prefix_lens, block_tables, scale
    ) -> torch.Tensor: ...

    @abc.abstractmethod
    def copy_blocks(self, k_cache, v_cache, src_block_ids, dst_block_ids) -> None: ...

    @abc.abstractmethod
    def gather_blocks(self, cache, block_ids) -> torch.Tensor: ...

    @abc.abstractmethod
    def scatter_blocks(self, cache, block_ids, blocks) -> None: ...

    def swap_out(self, cache: torch.Tensor, block_ids: torch.Tensor, host_blocks: torch.Tensor) -> None:
        """Copy `block_ids` of a device cache into `host_blocks` ([n, block_size, kv_heads, head_dim]).

        The kernel packs the blocks on the device, then one DMA copy moves them;
        this keeps host-device traffic to a single transfer per swap.
        """
        staged = self.gather_blocks(cache, block_ids.to(cache.device))
        host_blocks.copy_(staged, non_blocking=host_blocks.is_pinned())

    def swap_in(self, cache: torch.Tensor, block_ids: torch.Tensor, host_blocks: torch.Tensor) -> None:
        """Copy `host_blocks` back into `block_ids` of a device cache."""
        staged = host_blocks.to(cache.device, non_blocking=host_blocks.is_pinned())
        self.scatter_blocks(cache, block_ids.to(cache.device), staged)


class TorchKVKernels(KVKernelBackend):
    """Reference backend: plain torch ops, any device."""

    name = "torch"

    def append_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        reference.append_kv(key, value, k_cache, v_cache, slot_mapping)

    def paged_decode_attention(self, query, k_cache, v_cache, block_tables, context_lens, scale):
        return reference.paged_decode_attention(query, k_cache, v_cache, block_tables, context_lens, scale)

    def prefill_attention(self, query, k_cache, v_cache, cu_seqlens_q, prefix_lens, block_tables, scale):
        return reference.prefill_attention(query, k_cache, v_cache, cu_seqlens_q, prefix_lens, block_tables, scale)

    def copy_blocks(self, k_cache, v_cache, src_block_ids, dst_block_ids) -> None:
        reference.copy_blocks(k_cache, v_cache, src_block_ids, dst_block_ids)

    def gather_blocks(self, cache, block_ids):
        return reference.gather_blocks(cache, block_ids)

    def scatter_blocks(self, cache, block_ids, blocks) -> None:
        reference.scatter_blocks(cache, block_ids, blocks)


class TritonKVKernels(KVKernelBackend):
    """Triton backend for CUDA devices (and CPU tensors under TRITON_INTERPRET=1)."""

    name = "triton"

    def __init__(self) -> None:
        # Imported here: triton is optional at import time and reads
        # TRITON_INTERPRET when its kernels are defined.
        from kv_kernels import triton_kernels

        self._ops = triton_kernels

    def append_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        self._ops.append_kv(key, value, k_cache, v_cache, slot_mapping)

    def paged_decode_attention(self, query, k_cache, v_cache, block_tables, context_lens, scale):
        return self._ops.paged_decode_attention(query, k_cache, v_cache, block_tables, context_lens, scale)

    def prefill_attention(self, query, k_cache, v_cache, cu_seqlens_q, prefix_lens, block_tables, scale):
        return self._ops.prefill_attention(query, k_cache, v_cache, cu_seqlens_q, prefix_lens, block_tables, scale)

    def copy_blocks(self, k_cache, v_cache, src_block_ids, dst_block_ids) -> None:
        self._ops.copy_blocks(k_cache, v_cache, src_block_ids, dst_block_ids)

    def gather_blocks(self, cache, block_ids):
        return self._ops.gather_blocks(cache, block_ids)

    def scatter_blocks(self, cache, block_ids, blocks) -> None:
        self._ops.scatter_blocks(cache, block_ids, blocks)


def backend_for_device(device: torch.device | str) -> KVKernelBackend:
    """Triton on CUDA, the torch reference everywhere else."""
    if torch.device(device).type == "cuda":
        return TritonKVKernels()
    return TorchKVKernels()
