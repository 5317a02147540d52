"""The in-worker loop's admission: first come, first served, while KV blocks are free.

Pure (no torch): it decides which token chunks run in the next step and keeps
the allocator in step with those decisions. Length-aware policies (s3,
max_reserve, ...) replace this admission rule; the chunk format stays.
"""

from collections import deque
from dataclasses import dataclass

from workers.kv_cache_manager import BlockAllocator
from workers.sequence import Sequence, SequenceStatus


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """Compute `num_tokens` of `seq`, starting at its first uncomputed token."""

    seq: Sequence
    num_tokens: int

    @property
    def completes_sequence_tokens(self) -> bool:
        """After this chunk every known token has KV, so the step samples a new one."""
        return self.seq.num_computed_tokens + self.num_tokens == self.seq.num_tokens


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Limits of one engine step.

    Attributes:
        max_num_seqs: most sequences holding KV blocks at once.
        max_num_batched_tokens: most tokens in one forward; long prompts are
            prefilled in chunks that fit what decodes leave of it.
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}) so every running sequence can decode each step"
            )


class FcfsScheduler:
    """Admit in arrival order while blocks are free; on decode OOM preempt the newest and recompute it later."""

    def __init__(self, config: SchedulerConfig, allocator: BlockAllocator) -> None:
        self.config = config
        self.allocator = allocator
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledChunk]:
        """Pick the chunks of the next step, reserving the blocks they write."""
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            if not self._reserve_or_preempt(seq):
                continue
            num_tokens = min(seq.num_uncomputed_tokens, budget)
            if num_tokens == 0:
                continue
            chunks.append(ScheduledChunk(seq, num_tokens))
            budget -= num_tokens
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if self.allocator.allocate(seq.seq_id, seq.num_tokens) is None:
                break  # FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            num_tokens = min(seq.num_uncomputed_tokens, budget)
            chunks.append(ScheduledChunk(seq, num_tokens))
            budget -= num_tokens
        return chunks

    def finish(self, seq: Sequence) -> None:
        """Free a finished or aborted sequence's blocks."""
        self.allocator.release(seq.seq_id)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def _reserve_or_preempt(self, seq: Sequence) -> bool:
        """Make room for all of `seq`'s known tokens; preempt the newest running sequences if needed.

        Returns False when `seq` itself was the one preempted.
        """
        while self.allocator.extend(seq.seq_id, seq.num_tokens) is None:
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.allocator.release(seq.seq_id)
        self.running.remove(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
