"""What the scheduler hands the engine each step (`SchedulerOutput` of `ScheduledChunk`s) and what it counts
(`SchedulerStats`). Pure (no torch)."""

from dataclasses import dataclass, field

from workers.values.sequence import Sequence


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """Compute `num_tokens` of `seq`, starting at its first uncomputed token, in the blocks of `block_table` (the
    sequence's, in token order, as the step's schedule left them: the model runner reads them from here)."""

    seq: Sequence
    num_tokens: int
    block_table: list[int] = field(default_factory=list)

    @property
    def completes_sequence_tokens(self) -> bool:
        """After this chunk every known token has KV, so the step samples a new one."""
        return self.seq.num_computed_tokens + self.num_tokens == self.seq.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    """One step's decisions. Swaps run before the forward, swap-outs first."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    swap_out: list[tuple[Sequence, list[int]]] = field(default_factory=list)  # blocks to copy to host
    swap_in: list[tuple[Sequence, list[int]]] = field(default_factory=list)  # new blocks to copy back into


@dataclass(frozen=True, slots=True)
class MispredictionEvent:
    """A sequence outran the reservation its predicted bound bought."""

    seq_id: str
    predicted_output_tokens: int | None
    num_output_tokens: int
    step: int


# why a sequence was preempted: a running one could not grow; for a more urgent class; for much shorter work
PREEMPTION_CAUSES = ("kv", "priority", "shorter_work")


@dataclass(slots=True)
class SchedulerStats:
    num_preemptions: int = 0
    preemptions_by_cause: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PREEMPTION_CAUSES, 0))
    num_swaps: int = 0
    num_swapped_blocks: int = 0
    num_swaps_over_budget: int = 0  # victims the rule would have swapped, recomputed for want of swap space
    num_recomputed_tokens: int = 0
    num_prompt_tokens_admitted: int = 0  # prompts at their first admission
    num_prefix_hit_tokens: int = 0  # of those, found in the prefix cache (not computed again)
    mispredictions: list[MispredictionEvent] = field(default_factory=list)
