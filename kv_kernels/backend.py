"""Kernel backends: one interface, a torch reference, C++ CPU kernels and a Triton implementation.

The engine asks `backend_for_device(device)` once and, per layer, calls the
backend's `attention()` with the step's validated metadata; the single-op
methods validate their arguments and serve tests and tools. Tests build every
backend and compare them with the reference.
"""

import abc
import logging

import torch

from kv_kernels import reference
from kv_kernels.attention_metadata import AttentionMetadata

logger = logging.getLogger(__name__)


class KVKernelBackend(abc.ABC):
    """The KV-cache operations the engine needs. Signatures: see `kv_kernels.reference`."""

    name: str = "abstract"

    @abc.abstractmethod
    def attention(self, query, key, value, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                  window: int = 0) -> torch.Tensor:
        """One layer of a step: write the step's K/V [T, KVH, D] into the pool, attend; [T, H, D] -> [T, H, D].

        `window` > 0: a sliding-window layer, each query sees only its last `window` keys (its own included).

        Unchecked and without host syncs: the caller validated `meta` once for the step.
        """

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

    def row_argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """See reference.row_argmax."""
        return reference.row_argmax(logits)

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


class ModuleKVKernels(KVKernelBackend):
    """A backend whose operations are the same-named functions of one module.

    The reference, Triton and CPU modules share one set of names and signatures
    (`attention`, `append_kv`, `paged_decode_attention`, ...), so each backend is
    this class over its module.
    """

    def __init__(self, ops) -> None:
        self._ops = ops

    def attention(self, query, key, value, k_cache, v_cache, meta, scale, window=0):
        return self._ops.attention(query, key, value, k_cache, v_cache, meta, scale, window)

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


class TorchKVKernels(ModuleKVKernels):
    """Reference backend: plain torch ops, any device."""

    name = "torch"

    def __init__(self) -> None:
        super().__init__(reference)


class TritonKVKernels(ModuleKVKernels):
    """Triton backend for CUDA devices (and CPU tensors under TRITON_INTERPRET=1)."""

    name = "triton"

    def __init__(self) -> None:
        # Imported here: triton is optional at import time and reads
        # TRITON_INTERPRET when its kernels are defined.
        from kv_kernels import triton_kernels

        super().__init__(triton_kernels)


class CpuKVKernels(ModuleKVKernels):
    """C++ kernels for CPU tensors (`kv_kernels/csrc/`), built on first use if needed.

    Raises RuntimeError when the library cannot be built (no compiler).
    """

    name = "cpu"

    def __init__(self) -> None:
        from kv_kernels import cpu_build, cpu_kernels

        cpu_build.load()
        super().__init__(cpu_kernels)

    def row_argmax(self, logits: torch.Tensor) -> torch.Tensor:
        return self._ops.row_argmax(logits) if logits.device.type == "cpu" and logits.stride(-1) == 1 \
            else super().row_argmax(logits)


def backend_for_device(device: torch.device | str) -> KVKernelBackend:
    """Triton on CUDA; on CPU the C++ kernels, or the torch reference (with a warning) if they cannot be built."""
    kind = torch.device(device).type
    if kind == "cuda":
        return TritonKVKernels()
    if kind == "cpu":
        try:
            return CpuKVKernels()
        except (RuntimeError, OSError) as error:
            logger.warning("CPU kernels unavailable (%s); using the slower torch reference", error)
    return TorchKVKernels()
