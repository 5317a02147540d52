"""A worker's `WorkerStats` read off its engine between steps (the controller polls these)."""

from dataclasses import dataclass

from workers.engine.engine import Engine
from workers.scheduling.length_distribution import LengthDistribution
from workers.values.work_types import MAX_REPORTED_PREFIX_HASHES, BoundReport, OverrunReport, WorkerStats


@dataclass(frozen=True, slots=True)
class LoopCounters:
    """What the engine loop counts itself (the engine does not know about requests moving)."""

    num_generated_tokens: int
    num_migrated_in: int
    num_migrated_out: int


REMAINING = LengthDistribution()  # how the controller's routing reads each live request's prediction (immutable)


def snapshot(engine: Engine, worker_id: str, counters: LoopCounters) -> WorkerStats:
    """The engine's blocks, load, preempted sequences (overruns), probe-re-bounded sequences and each live
    request's expected remaining work now."""
    scheduler, allocator = engine.scheduler, engine.allocator
    running, waiting = list(scheduler.running), list(scheduler.waiting)
    overruns = tuple(
        OverrunReport(
            request_id=seq.seq_id,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            predicted_output_tokens=seq.predicted_output_tokens,
            num_blocks_needed=allocator.blocks_for(scheduler.policy.reservation_tokens(seq)),
        )
        for seq in waiting
        if seq.num_preemptions > 0
    )
    rebounded = tuple(
        BoundReport(seq.seq_id, seq.num_output_tokens, seq.predicted_output_tokens,
                    allocator.num_reserved_tokens(seq.seq_id) if allocator.has(seq.seq_id) else 0)
        for seq in running + waiting
        if seq.num_probe_reads > 0 and seq.predicted_output_tokens is not None
    )
    return WorkerStats(
        worker_id=worker_id,
        num_total_blocks=allocator.num_blocks,
        num_free_blocks=allocator.num_free_blocks,
        num_used_blocks=engine.used_blocks(),
        num_reserved_blocks=allocator.num_reserved_blocks,
        block_size=allocator.block_size,
        bytes_per_block=engine.runner.pool_shape.bytes_per_block,
        num_running=len(running),
        num_waiting=len(waiting),
        num_steps=engine.num_steps,
        num_generated_tokens=counters.num_generated_tokens,
        num_overruns=len(scheduler.stats.mispredictions),
        num_preemptions=scheduler.stats.num_preemptions,
        num_migrated_in=counters.num_migrated_in,
        num_migrated_out=counters.num_migrated_out,
        overruns=overruns,
        request_ids=tuple(seq.seq_id for seq in running + waiting),
        remaining_tokens=tuple(
            round(REMAINING.remaining_of(seq.length_center_tokens, seq.num_output_tokens, seq.params.max_tokens,
                                         seq.is_looping))
            for seq in running + waiting),
        prefix_hashes=tuple(allocator.cache.recent_hashes(MAX_REPORTED_PREFIX_HASHES)),
        num_prompt_tokens=scheduler.stats.num_prompt_tokens_admitted,
        num_prefix_hit_tokens=scheduler.stats.num_prefix_hit_tokens,
        rebounded=rebounded,
        num_probe_reads=engine.num_probe_reads,
    )
