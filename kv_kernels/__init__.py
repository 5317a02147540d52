"""Paged KV-cache kernels: block-pool layout, torch reference and Triton kernels."""

from kv_kernels.backend import KVKernelBackend, TorchKVKernels, TritonKVKernels, backend_for_device
from kv_kernels.layout import BlockPoolShape, allocate_block_pool

__all__ = [
    "BlockPoolShape",
    "KVKernelBackend",
    "TorchKVKernels",
    "TritonKVKernels",
    "allocate_block_pool",
    "backend_for_device",
]
