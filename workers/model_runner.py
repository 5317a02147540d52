"""Runs one ragged forward of a DeepSpeed-wrapped Hugging Face model over paged KV."""

import torch

from kv_kernels import BlockPoolShape, KVKernelBackend, allocate_block_pool
from workers.attention import AttentionBatch, register_paged_attention
from workers.kv_cache_manager import BlockAllocator
from workers.scheduler import ScheduledChunk


def pool_shape_for(model_config, num_blocks: int, block_size: int, dtype: torch.dtype) -> BlockPoolShape:
    """Block-pool geometry of a Hugging Face decoder config."""
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // model_config.num_attention_heads
    return BlockPoolShape(
        num_layers=model_config.num_hidden_layers,
        num_blocks=num_blocks,
        block_size=block_size,
        num_kv_heads=model_config.num_key_value_heads,
        head_dim=head_dim,
        dtype=dtype,
    )


def wrap_with_deepspeed(model: torch.nn.Module, tensor_parallel_size: int) -> torch.nn.Module:
    """`deepspeed.init_inference` without kernel injection: our attention stays in charge.

    On CUDA, tensor_parallel_size > 1 shards the linear layers across the
    node's GPUs; on the CPU accelerator it must be 1.
    """
    import deepspeed

    return deepspeed.init_inference(
        model,
        tensor_parallel={"tp_size": tensor_parallel_size},
        dtype=model.dtype,
        replace_with_kernel_inject=False,
    )


class ModelRunner:
    """Owns the model and the KV block pool; turns scheduled chunks into logits.

    Args:
        model: a Hugging Face causal LM (Llama family), eval mode.
        num_blocks, block_size: pool geometry (the allocator's).
        backend: KV kernels for the model's device.
        tensor_parallel_size: passed to DeepSpeed.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        num_blocks: int,
        block_size: int,
        backend: KVKernelBackend,
        tensor_parallel_size: int = 1,
    ) -> None:
        model.set_attn_implementation(register_paged_attention())
        self.device = next(model.parameters()).device
        self.backend = backend
        self.block_size = block_size
        self.pool_shape = pool_shape_for(model.config, num_blocks, block_size, model.dtype)
        self.kv_caches = allocate_block_pool(self.pool_shape, self.device)
        self.model = wrap_with_deepspeed(model, tensor_parallel_size)
        # seq_id -> per layer (k_blocks, v_blocks), each [num_blocks, block_size, kv_heads, head_dim] on the host
        self._swapped: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def swap_out(self, seq_id: str, block_ids: list[int]) -> int:
        """Copy a preempted sequence's blocks to host memory; returns the bytes moved."""
        self._swapped[seq_id] = self.copy_to_host(block_ids)
        return len(block_ids) * self.pool_shape.bytes_per_block

    def copy_to_host(self, block_ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (k_blocks, v_blocks) host copies of `block_ids`, each [n, block_size, kv_heads, head_dim]."""
        ids = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        host_shape = (len(block_ids), *self.pool_shape.layer_shape()[1:])
        pin = self.device.type == "cuda"
        saved = []
        for k_cache, v_cache in self.kv_caches:
            k_host = torch.empty(host_shape, dtype=k_cache.dtype, pin_memory=pin)
            v_host = torch.empty(host_shape, dtype=v_cache.dtype, pin_memory=pin)
            self.backend.swap_out(k_cache, ids, k_host)
            self.backend.swap_out(v_cache, ids, v_host)
            saved.append((k_host, v_host))
        return saved

    def swapped_copy(self, seq_id: str) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """The host blocks of a swapped-out sequence (not a copy), or None."""
        return self._swapped.get(seq_id)

    def import_swapped(self, seq_id: str, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Take host blocks from elsewhere (another worker) as `seq_id`'s swap copy; swap-in copies them in."""
        self._swapped[seq_id] = list(layers)

    def swap_in(self, seq_id: str, block_ids: list[int]) -> int:
        """Copy a sequence's host blocks into its newly allocated blocks; returns the bytes moved."""
        saved = self._swapped.pop(seq_id)
        ids = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        for (k_cache, v_cache), (k_host, v_host) in zip(self.kv_caches, saved):
            self.backend.swap_in(k_cache, ids, k_host)
            self.backend.swap_in(v_cache, ids, v_host)
        return len(block_ids) * self.pool_shape.bytes_per_block

    def drop_swapped(self, seq_id: str) -> None:
        """Forget host blocks of a sequence that will not come back (aborted)."""
        self._swapped.pop(seq_id, None)

    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk], allocator: BlockAllocator) -> tuple[torch.Tensor, list[ScheduledChunk]]:
        """Forward the chunks; return logits [num_sampling, vocab] and the chunks they belong to."""
        prefills = [chunk for chunk in chunks if chunk.num_tokens > 1]
        decodes = [chunk for chunk in chunks if chunk.num_tokens == 1]
        ordered = prefills + decodes
        block_size = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        sampling_chunks: list[ScheduledChunk] = []
        for chunk in ordered:
            seq = chunk.seq
            start = seq.num_computed_tokens
            end = start + chunk.num_tokens
            table = allocator.block_table(seq.seq_id)
            input_ids.extend(seq.tokens_between(start, end))
            positions.extend(range(start, end))
            slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, end))
            tables.append(table)
            if chunk.completes_sequence_tokens:
                sample_rows.append(len(input_ids) - 1)
                sampling_chunks.append(chunk)
        device = self.device
        num_prefill_tokens = sum(chunk.num_tokens for chunk in prefills)
        cu_seqlens = [0]
        for chunk in prefills:
            cu_seqlens.append(cu_seqlens[-1] + chunk.num_tokens)
        batch = AttentionBatch(
            kv_caches=self.kv_caches,
            backend=self.backend,
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            num_prefill_tokens=num_prefill_tokens,
            cu_seqlens_q=torch.tensor(cu_seqlens, dtype=torch.int32, device=device),
            prefill_prefix_lens=torch.tensor(
                [c.seq.num_computed_tokens for c in prefills], dtype=torch.int32, device=device
            ),
            prefill_block_tables=_pad_tables(tables[: len(prefills)], device),
            decode_block_tables=_pad_tables(tables[len(prefills):], device),
            decode_context_lens=torch.tensor(
                [c.seq.num_computed_tokens + 1 for c in decodes], dtype=torch.int32, device=device
            ),
        )
        # An all-partial-prefill step samples nothing; keep one row so
        # logits_to_keep is never empty (an int 0 would mean "keep all").
        keep = sample_rows or [len(input_ids) - 1]
        outputs = self.model(
            input_ids=torch.tensor([input_ids], dtype=torch.long, device=device),
            position_ids=torch.tensor([positions], dtype=torch.long, device=device),
            logits_to_keep=torch.tensor(keep, dtype=torch.long, device=device),
            use_cache=False,
            s3_batch=batch,
        )
        logits = outputs.logits[0, : len(sample_rows)].float()  # [num_sampling, vocab]
        return logits, sampling_chunks


def _pad_tables(tables: list[list[int]], device: torch.device) -> torch.Tensor:
    """Block tables as one int32 tensor [num_seqs, max_blocks], padded with block 0 (never read)."""
    width = max((len(table) for table in tables), default=1) or 1
    return torch.tensor([table + [0] * (width - len(table)) for table in tables], dtype=torch.int32, device=device).reshape(
        len(tables), width
    )
