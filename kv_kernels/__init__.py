"""Paged KV-cache kernels: block-pool layout, step metadata, torch reference, C++ CPU and Triton kernels."""

from kv_kernels.attention_metadata import AttentionMetadata, build_attention_metadata
from kv_kernels.backend import CpuKVKernels, KVKernelBackend, TorchKVKernels, TritonKVKernels, backend_for_device
from kv_kernels.layout import BlockPoolShape, allocate_block_pool

__all__ = [
    "AttentionMetadata",
    "BlockPoolShape",
    "CpuKVKernels",
    "KVKernelBackend",
    "TorchKVKernels",
    "TritonKVKernels",
    "allocate_block_pool",
    "backend_for_device",
    "build_attention_metadata",
]
