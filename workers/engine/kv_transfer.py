"""A sequence's KV cache as host tensors, to move it from one worker's engine to another's.

The exporting engine copies the blocks holding the sequence's computed tokens
to host memory (or hands over its swap copy if the sequence is swapped out);
the importing engine treats the copy as if the sequence had been swapped out
there, so the ordinary swap-in path writes it into fresh blocks:

    engine A                         Ray object store            engine B
    blocks [7, 2, 9] --gather--> ExportedKV(layers, n) --> waiting, is_swapped
                                                               --swap-in--> blocks [0, 5, 3]

Only the first `num_computed_tokens` tokens are valid; the last block may be
partly filled (its tail is garbage that the next writes overwrite).
"""

from dataclasses import dataclass

import torch

from kv_kernels import BlockPoolShape


@dataclass(frozen=True, slots=True)
class ExportedKV:
    """KV of a sequence's first `num_computed_tokens` tokens, one (k, v) host pair per layer.

    Attributes:
        layers: per decoder layer, (k_blocks, v_blocks), each
            [num_blocks, block_size, num_kv_heads, head_dim] on the CPU.
        num_computed_tokens: tokens whose KV the blocks hold, in token order.
        block_size: tokens per block of the exporting pool.
    """

    layers: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    num_computed_tokens: int
    block_size: int

    def __post_init__(self) -> None:
        if self.num_computed_tokens < 0:
            raise ValueError(f"num_computed_tokens must be >= 0, got {self.num_computed_tokens}")
        needed = -(-self.num_computed_tokens // self.block_size)
        for k_blocks, v_blocks in self.layers:
            if k_blocks.shape != v_blocks.shape or k_blocks.dim() != 4 or k_blocks.shape[0] != needed:
                raise ValueError(
                    f"each layer needs K and V of shape [{needed}, {self.block_size}, kv_heads, head_dim] for "
                    f"{self.num_computed_tokens} tokens, got {tuple(k_blocks.shape)} and {tuple(v_blocks.shape)}"
                )

    @property
    def num_blocks(self) -> int:
        return -(-self.num_computed_tokens // self.block_size)

    @property
    def num_bytes(self) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.layers)

    def check_fits(self, pool: BlockPoolShape) -> None:
        """Raise ValueError unless this KV can be copied into blocks of `pool`."""
        if self.num_computed_tokens == 0:
            return  # nothing to copy
        expected = (self.block_size, pool.num_kv_heads, pool.head_dim)
        if self.block_size != pool.block_size or len(self.layers) != pool.num_layers:
            raise ValueError(
                f"KV from a pool with {len(self.layers)} layers and block_size {self.block_size} cannot enter "
                f"a pool with {pool.num_layers} layers and block_size {pool.block_size}"
            )
        for k_blocks, _ in self.layers:
            if tuple(k_blocks.shape[1:]) != expected or k_blocks.dtype != pool.dtype:
                raise ValueError(
                    f"KV blocks of shape {tuple(k_blocks.shape[1:])} and dtype {k_blocks.dtype} do not match "
                    f"the pool's {expected} and {pool.dtype}"
                )

    def truncated(self, num_tokens: int) -> "ExportedKV":
        """The KV of the first `num_tokens` tokens only (views, no copy)."""
        if not 0 <= num_tokens <= self.num_computed_tokens:
            raise ValueError(f"cannot keep {num_tokens} of {self.num_computed_tokens} computed tokens")
        num_blocks = -(-num_tokens // self.block_size)
        return ExportedKV(
            tuple((k[:num_blocks], v[:num_blocks]) for k, v in self.layers), num_tokens, self.block_size
        )
