"""Drives a worker's scheduler on synthetic requests without a model, for the policy tests.

`simulate` plays the engine's part: it runs the scheduler's chunks, marks
their tokens computed, appends a fake token to every sequence whose known
tokens are all cached, and finishes sequences at their forced length.
"""

import random

from workers.scheduling.kv_cache_manager import BlockAllocator
from workers.scheduling.preemption import PreemptionRule
from workers.scheduling.scheduler import Scheduler, SchedulerConfig
from workers.values.sampling_params import SamplingParams
from workers.values.sequence import Sequence, SequenceStatus

BLOCK_SIZE = 4
MAX_LEN = 256


def make_requests(num: int, seed: int = 0, prediction_error: float | None = 0.0) -> list[Sequence]:
    """Sequences with random prompt and forced output lengths; predicted bound = true * (1 + error)."""
    rng = random.Random(seed)
    seqs = []
    for i in range(num):
        prompt_len = rng.randint(1, 40)
        true_len = rng.randint(1, 120)
        predicted = None if prediction_error is None else max(1, int(true_len * (1 + prediction_error)))
        seqs.append(Sequence(
            seq_id=f"r{i}",
            prompt_token_ids=list(range(prompt_len)),
            params=SamplingParams(max_tokens=MAX_LEN - prompt_len, ignore_eos=True, forced_output_tokens=true_len),
            predicted_output_tokens=predicted,
        ))
    return seqs


def simulate(policy, seqs: list[Sequence], num_blocks: int, max_num_seqs: int = 64, max_steps: int = 20_000,
             preemption: PreemptionRule | None = None):
    """Run to completion; returns (scheduler, allocator, per-step running counts, swapped-out sequence ids).
    Preempted sequences recompute unless `preemption` says otherwise."""
    allocator = BlockAllocator(num_blocks, BLOCK_SIZE)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs, 64), allocator, policy, preemption)
    for seq in seqs:
        scheduler.add(seq)
    running_counts, swapped = [], set()
    for _ in range(max_steps):
        if not scheduler.has_unfinished():
            break
        out = scheduler.schedule()
        assert allocator.num_reserved_blocks <= num_blocks
        allocator.check_invariants()
        for seq, block_ids in out.swap_out:
            swapped.add(seq.seq_id)
        for seq, block_ids in out.swap_in:
            assert seq.seq_id in swapped
            assert len(block_ids) == allocator.blocks_for(seq.num_computed_tokens)
        running_counts.append(len(scheduler.running))
        run_step(scheduler, out)
    assert not scheduler.has_unfinished(), "simulation did not finish"
    return scheduler, allocator, running_counts, swapped


def run_step(scheduler: Scheduler, out) -> None:
    """The engine's part of a step: compute the chunks, sample a token where a sequence's known tokens are all
    computed, finish at the forced length."""
    for chunk in out.chunks:
        seq = chunk.seq
        samples = chunk.completes_sequence_tokens
        assert scheduler.allocator.num_reserved_tokens(seq.seq_id) >= seq.num_computed_tokens + chunk.num_tokens
        seq.num_computed_tokens += chunk.num_tokens
        if samples:
            seq.output_token_ids.append(7)
            if seq.num_output_tokens == seq.params.forced_output_tokens:
                seq.status = SequenceStatus.FINISHED
                scheduler.finish(seq)


def waiting_seq(seq_id: str, arrival_s: float, predicted: int, decoded: int = 0) -> Sequence:
    """A 10-token prompt with `decoded` outputs so far, predicted to answer `predicted` tokens."""
    seq = Sequence(seq_id, list(range(10)), SamplingParams(max_tokens=500), arrival_s=arrival_s,
                   predicted_output_tokens=predicted)
    seq.output_token_ids = [7] * decoded
    return seq
