"""What prefix caching asks of admission: the block hashes a waiting sequence could share (hashed once per length
while it waits), and whether it should wait a step because a running sequence is computing the first block it
would share (a step later that block is cached and shared instead of computed twice). Pure (no torch); the
scheduler (`workers.scheduling.scheduler`) tells it when sequences start, stop and finish."""

from workers.scheduling.kv_cache_manager import BlockAllocator
from workers.values.sequence import Sequence


class PrefixSharing:
    """Per-sequence prefix hashes of one worker's scheduler, over its block allocator."""

    def __init__(self, allocator: BlockAllocator) -> None:
        self._allocator = allocator
        self._first_block: dict[str, int] = {}  # running sequence -> hash of its first full block
        # waiting sequence -> (its known tokens, the block hashes it could share): hashed once while it waits
        self._hashes: dict[str, tuple[int, list[int]]] = {}

    def started(self, seq: Sequence) -> None:
        """`seq` was admitted: its first block is in progress until computed (one brought back by swapping is not)."""
        self._hashes.pop(seq.seq_id, None)
        first = None if seq.is_swapped else self._allocator.first_block_hash(seq.prompt_token_ids)
        if first is not None:
            self._first_block[seq.seq_id] = first

    def stopped(self, seq: Sequence) -> None:
        """`seq` was preempted: it computes nothing for now."""
        self._first_block.pop(seq.seq_id, None)

    def forget(self, seq: Sequence) -> None:
        """`seq` finished or was aborted."""
        self._first_block.pop(seq.seq_id, None)
        self._hashes.pop(seq.seq_id, None)

    def blocks_in_progress(self, running: list[Sequence]) -> set[int]:
        """Hashes of the first blocks running sequences are computing still."""
        return {self._first_block[s.seq_id] for s in running
                if s.seq_id in self._first_block and s.num_computed_tokens < self._allocator.block_size}

    def waits_for_first_block(self, seq: Sequence, in_progress: set[int]) -> bool:
        """A running sequence is computing the (uncached) first block `seq` would share (a sequence that scores its
        prompt shares nothing, so never waits). `in_progress`: `blocks_in_progress` of the running ones."""
        if seq.is_swapped or seq.prompt_logprobs is not None:
            return False
        first = self._allocator.first_block_hash(seq.prompt_token_ids)
        return first is not None and not self._allocator.is_cached(first) and first in in_progress

    def shareable_hashes(self, seq: Sequence) -> list[int] | None:
        """The block hashes waiting `seq` could share; None when it brings its own KV back (swapped in), must
        compute its prompt to score it (`prompt_logprobs`) or caching is off. Hashed once per length while it
        waits, not at every admission attempt."""
        if seq.is_swapped or seq.prompt_logprobs is not None or not self._allocator.enable_prefix_caching:
            return None
        known = self._hashes.get(seq.seq_id)
        if known is None or known[0] != seq.num_tokens:
            hashes = self._allocator.prefix_hashes(seq.tokens_between(0, seq.num_tokens))
            known = self._hashes[seq.seq_id] = (seq.num_tokens, hashes)
        return known[1]
