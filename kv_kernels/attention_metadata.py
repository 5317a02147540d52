"""Per-step attention metadata: built once per engine step, validated once, read by every layer.

One step is a ragged batch of query tokens, prefill chunks first, then decodes
(one token each):

    query tokens:  [ chunk 0 | chunk 1 | ... | decode 0 | decode 1 | ... ]
    query_start_loc: 0 ...... q0 ...... q1    ...   T-2        T-1        T
    seq_lens:        cached tokens of each sequence after this step (prefix + its chunk)

Query token j of a chunk of length q sits at position seq_len - q + j and attends
to cache positions 0 ..= that position. Backends that split prefills from decodes
(the torch reference, Triton) read the derived views; the CPU kernel reads the
unified ones. Host-side lists ride along so that no layer calls `.tolist()`.
"""

from dataclasses import dataclass

import torch

from kv_kernels.layout import BlockPoolShape


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Where this step's tokens go in the KV pool and what each one attends to.

    Attributes:
        slot_mapping: [T] int64 cache slot of every query token (negative: padding, not written).
        block_tables: [S, W] int32 block ids per sequence; entries past a sequence's blocks are 0.
        query_start_loc: [S + 1] int32 cumulative query lengths.
        seq_lens: [S] int32 cached tokens per sequence after this step.
        num_prefills: leading sequences that are prefill chunks (the rest decode one token).
        num_prefill_tokens: query tokens of those chunks.
        max_query_len: longest chunk (1 when only decodes run).
        query_lens_host: per-sequence query lengths (host list).
        seq_lens_host: `seq_lens` as a host list.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    num_prefills: int
    num_prefill_tokens: int
    max_query_len: int
    query_lens_host: tuple[int, ...]
    seq_lens_host: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    # -- views for backends that run prefills and decodes apart --------------

    @property
    def prefill_cu_seqlens(self) -> torch.Tensor:
        """[P + 1] chunk boundaries within the prefill tokens."""
        return self.query_start_loc[: self.num_prefills + 1]

    @property
    def prefill_prefix_lens(self) -> torch.Tensor:
        """[P] tokens cached before each chunk."""
        lens = self.seq_lens[: self.num_prefills]
        return lens - (self.query_start_loc[1 : self.num_prefills + 1] - self.query_start_loc[: self.num_prefills])

    @property
    def prefill_block_tables(self) -> torch.Tensor:
        return self.block_tables[: self.num_prefills]

    @property
    def decode_block_tables(self) -> torch.Tensor:
        return self.block_tables[self.num_prefills :]

    @property
    def decode_context_lens(self) -> torch.Tensor:
        """[D] context length of each decode, its new token included."""
        return self.seq_lens[self.num_prefills :]


def build_attention_metadata(
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    slot_mapping: list[int],
    num_prefills: int,
    pool: BlockPoolShape,
    device: torch.device | str,
) -> AttentionMetadata:
    """Check a step's host-side metadata against the pool once, then move it to `device`.

    Raises ValueError naming the offending values: a table that cannot hold its
    sequence, a block id or slot outside the pool, or prefills that are not first.
    """
    num_seqs = len(query_lens)
    if len(seq_lens) != num_seqs or len(block_tables) != num_seqs:
        raise ValueError(f"{num_seqs} query lengths but {len(seq_lens)} seq_lens and {len(block_tables)} tables")
    if any(q < 1 for q in query_lens) or any(s < q for s, q in zip(seq_lens, query_lens)):
        raise ValueError(f"each sequence needs 1 <= query_len <= seq_len, got {list(zip(query_lens, seq_lens))}")
    if any(q != 1 for q in query_lens[num_prefills:]):
        raise ValueError(f"sequences after the {num_prefills} prefills must decode one token, got {query_lens}")
    num_tokens = sum(query_lens)
    if len(slot_mapping) != num_tokens:
        raise ValueError(f"{len(slot_mapping)} slots for {num_tokens} query tokens")
    for seq, (table, seq_len) in enumerate(zip(block_tables, seq_lens)):
        if len(table) * pool.block_size < seq_len:
            raise ValueError(f"sequence {seq}: {len(table)} blocks cannot hold {seq_len} tokens")
    every_block = [block for table in block_tables for block in table]
    if every_block and (min(every_block) < 0 or max(every_block) >= pool.num_blocks):
        raise ValueError(f"block ids must lie in [0, {pool.num_blocks}), got [{min(every_block)}, {max(every_block)}]")
    num_slots = pool.num_blocks * pool.block_size
    if slot_mapping and max(slot_mapping) >= num_slots:
        raise ValueError(f"slots must lie below {num_slots}, got {max(slot_mapping)}")
    width = max((len(table) for table in block_tables), default=1) or 1
    tables = torch.tensor([table + [0] * (width - len(table)) for table in block_tables], dtype=torch.int32)
    tables = tables.reshape(num_seqs, width)
    starts = [0]
    for length in query_lens:
        starts.append(starts[-1] + length)
    pin = torch.device(device).type == "cuda"

    def put(values, dtype) -> torch.Tensor:
        host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
        if pin:
            host = host.pin_memory()
        return host.to(device, non_blocking=pin)

    return AttentionMetadata(
        slot_mapping=put(slot_mapping, torch.int64),
        block_tables=put(tables, torch.int32),
        query_start_loc=put(starts, torch.int32),
        seq_lens=put(seq_lens, torch.int32),
        num_prefills=num_prefills,
        num_prefill_tokens=starts[num_prefills],
        max_query_len=max(query_lens, default=1),
        query_lens_host=tuple(query_lens),
        seq_lens_host=tuple(seq_lens),
    )
