"""The scheduler with its default policy (on-demand paging) and without a model: the test plays the model runner, advancing progress and appending fake tokens."""

import random

import pytest

from workers.scheduling.kv_cache_manager import BlockAllocator
from workers.scheduling.scheduler import Scheduler, SchedulerConfig
from workers.scheduling.scheduler_output import ScheduledChunk
from workers.values.sampling_params import SamplingParams
from workers.values.sequence import Sequence, SequenceStatus

BLOCK_SIZE = 4


def make_seq(seq_id: str, num_prompt_tokens: int, max_tokens: int = 8) -> Sequence:
    return Sequence(
        seq_id=seq_id,
        prompt_token_ids=list(range(num_prompt_tokens)),
        params=SamplingParams(max_tokens=max_tokens),
    )


def make_scheduler(num_blocks: int = 64, max_num_seqs: int = 8, max_num_batched_tokens: int = 64) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs, max_num_batched_tokens), BlockAllocator(num_blocks, BLOCK_SIZE))


def fake_token(seq: Sequence) -> int:
    """Output token i of every sequence is 1000 + i, so a lost or doubled token shows."""
    return 1000 + len(seq.output_token_ids)


def run_chunks(scheduler: Scheduler, chunks: list[ScheduledChunk]) -> list[Sequence]:
    """Do what the engine does after a forward; return the sequences that finished."""
    finished = []
    for chunk in chunks:
        completes = chunk.completes_sequence_tokens
        chunk.seq.num_computed_tokens += chunk.num_tokens
        if not completes:
            continue
        seq = chunk.seq
        seq.output_token_ids.append(fake_token(seq))
        if len(seq.output_token_ids) == seq.params.max_tokens:
            seq.status = SequenceStatus.FINISHED
            scheduler.finish(seq)
            finished.append(seq)
    return finished


def schedule(scheduler: Scheduler) -> list[ScheduledChunk]:
    """One step's chunks; the default policy recomputes, so it never swaps."""
    out = scheduler.schedule()
    assert out.swap_out == [] and out.swap_in == []
    return out.chunks


def scheduled(chunks: list[ScheduledChunk]) -> list[tuple[str, int]]:
    return [(chunk.seq.seq_id, chunk.num_tokens) for chunk in chunks]


def test_admits_in_arrival_order_while_blocks_are_free():
    scheduler = make_scheduler(num_blocks=4)
    a, b, c = make_seq("a", 8), make_seq("b", 12), make_seq("c", 1)
    for seq in (a, b, c):
        scheduler.add(seq)
    # a takes 2 blocks; b needs 3 of the 2 left; c would fit but must not overtake b.
    assert scheduled(schedule(scheduler)) == [("a", 8)]
    assert scheduler.running == [a]
    assert list(scheduler.waiting) == [b, c]
    assert a.status is SequenceStatus.RUNNING and b.status is SequenceStatus.WAITING
    assert scheduler.allocator.block_table("a") == [0, 1]
    assert not scheduler.allocator.has("b") and not scheduler.allocator.has("c")


def test_finish_frees_blocks_and_lets_the_queue_move():
    scheduler = make_scheduler(num_blocks=4)
    a, b = make_seq("a", 8), make_seq("b", 12)
    scheduler.add(a)
    scheduler.add(b)
    run_chunks(scheduler, schedule(scheduler))
    scheduler.finish(a)
    assert not scheduler.allocator.has("a")
    assert scheduler.allocator.num_free_blocks == 4
    assert scheduler.running == []
    assert scheduled(schedule(scheduler)) == [("b", 12)]
    assert scheduler.allocator.num_free_blocks == 1


def test_finish_of_a_waiting_sequence_drops_it_from_the_queue():
    scheduler = make_scheduler(num_blocks=1)
    a, b = make_seq("a", 4), make_seq("b", 4)
    scheduler.add(a)
    scheduler.add(b)
    schedule(scheduler)
    scheduler.finish(b)
    assert list(scheduler.waiting) == []
    assert scheduler.has_unfinished()
    scheduler.finish(a)
    assert not scheduler.has_unfinished()
    assert scheduler.allocator.num_free_blocks == 1


def test_max_num_seqs_caps_running_sequences():
    scheduler = make_scheduler(max_num_seqs=2)
    seqs = [make_seq(f"s{i}", 3, max_tokens=2) for i in range(5)]
    for seq in seqs:
        scheduler.add(seq)
    chunks = schedule(scheduler)
    assert scheduled(chunks) == [("s0", 3), ("s1", 3)]
    assert len(scheduler.waiting) == 3
    run_chunks(scheduler, chunks)
    chunks = schedule(scheduler)
    assert scheduled(chunks) == [("s0", 1), ("s1", 1)]  # a free seat is needed, not just free blocks
    run_chunks(scheduler, chunks)  # both reach max_tokens=2 and finish
    assert scheduled(schedule(scheduler)) == [("s2", 3), ("s3", 3)]


def test_chunked_prefill_fits_the_token_budget():
    scheduler = make_scheduler(max_num_seqs=2, max_num_batched_tokens=8)
    a, b = make_seq("a", 20), make_seq("b", 5)
    scheduler.add(a)
    scheduler.add(b)
    steps = []
    for _ in range(4):
        chunks = schedule(scheduler)
        steps.append(scheduled(chunks))
        assert [c.completes_sequence_tokens for c in chunks] == [
            c.seq.num_computed_tokens + c.num_tokens == c.seq.num_tokens for c in chunks
        ]
        run_chunks(scheduler, chunks)
    # a's prompt spans three steps; b joins with what a leaves; decodes come first once running.
    assert steps == [
        [("a", 8)],
        [("a", 8)],
        [("a", 4), ("b", 4)],
        [("a", 1), ("b", 1)],
    ]
    assert a.output_token_ids == [1000, 1001]
    assert b.output_token_ids == [1000]


def test_decodes_keep_their_token_while_a_long_prompt_is_chunked():
    scheduler = make_scheduler(max_num_seqs=3, max_num_batched_tokens=4)
    a, b, c = make_seq("a", 2, max_tokens=20), make_seq("b", 2, max_tokens=20), make_seq("c", 30)
    for seq in (a, b):
        scheduler.add(seq)
    run_chunks(scheduler, schedule(scheduler))
    scheduler.add(c)
    for _ in range(5):
        chunks = schedule(scheduler)
        assert scheduled(chunks) == [("a", 1), ("b", 1), ("c", 2)]
        run_chunks(scheduler, chunks)
    assert c.num_computed_tokens == 10


def test_decode_out_of_blocks_preempts_the_newest_for_recompute():
    scheduler = make_scheduler(num_blocks=4, max_num_seqs=4)
    a, b, c = make_seq("a", 8), make_seq("b", 8), make_seq("c", 4)
    scheduler.add(a)
    scheduler.add(b)
    run_chunks(scheduler, schedule(scheduler))  # both prefilled, one token each: 9 tokens, 2 blocks each
    scheduler.add(c)
    chunks = schedule(scheduler)
    # a needs a third block, none is free: b, the newest, loses its blocks.
    assert scheduled(chunks) == [("a", 1)]
    assert scheduler.running == [a]
    assert list(scheduler.waiting) == [b, c]
    assert b.status is SequenceStatus.WAITING
    assert b.num_computed_tokens == 0
    assert b.output_token_ids == [1000]  # kept: recompute rebuilds their KV
    assert b.num_preemptions == 1 and a.num_preemptions == 0
    assert scheduler.num_preemptions == 1
    assert not scheduler.allocator.has("b")
    assert scheduler.allocator.block_table("a") == [0, 1, 2]
    scheduler.allocator.check_invariants()


def test_the_newest_preempts_itself_rather_than_an_older_sequence():
    scheduler = make_scheduler(num_blocks=3, max_num_seqs=4)
    a, b = make_seq("a", 7), make_seq("b", 4)
    scheduler.add(a)
    scheduler.add(b)
    run_chunks(scheduler, schedule(scheduler))  # a: 8 tokens in 2 blocks; b: 5 tokens, needs a second block
    chunks = schedule(scheduler)
    assert scheduled(chunks) == [("a", 1)]
    assert list(scheduler.waiting) == [b]
    assert b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert scheduler.allocator.block_table("a") == [0, 1]


def simulate(scheduler: Scheduler, arrivals: dict[int, list[Sequence]], max_steps: int = 2000) -> list[Sequence]:
    """Drive schedule() to the end, checking the step limits and the pool after every step."""
    config, allocator = scheduler.config, scheduler.allocator
    finished: list[Sequence] = []
    step = 0
    while step <= max(arrivals) or scheduler.has_unfinished():
        assert step < max_steps, "no progress"
        for seq in arrivals.get(step, []):
            scheduler.add(seq)
        holding_kv = {seq.seq_id for seq in scheduler.running}
        chunks = schedule(scheduler)
        if scheduler.has_unfinished():
            assert chunks, f"step {step}: sequences are waiting but nothing was scheduled"
        ids = [chunk.seq.seq_id for chunk in chunks]
        assert len(ids) == len(set(ids))
        assert sum(chunk.num_tokens for chunk in chunks) <= config.max_num_batched_tokens
        assert all(chunk.num_tokens >= 1 for chunk in chunks)
        assert len(scheduler.running) <= config.max_num_seqs
        # Every running sequence moves each step (decodes are never starved).
        assert sorted(ids) == sorted(seq.seq_id for seq in scheduler.running)
        for chunk in chunks:
            assert chunk.seq.status is SequenceStatus.RUNNING
            if chunk.seq.seq_id not in holding_kv:
                # Admitted (or readmitted after preemption) this step: no KV yet, so it starts at token 0.
                assert chunk.seq.num_computed_tokens == 0
            assert allocator.num_reserved_tokens(chunk.seq.seq_id) >= chunk.seq.num_computed_tokens + chunk.num_tokens
        assert allocator.num_reserved_blocks <= allocator.num_blocks
        allocator.check_invariants()
        finished.extend(run_chunks(scheduler, chunks))
        step += 1
    return finished


def random_arrivals(seed: int, num_seqs: int, max_total_tokens: int) -> tuple[list[Sequence], dict[int, list[Sequence]]]:
    rng = random.Random(seed)
    seqs, arrivals = [], {}
    for i in range(num_seqs):
        num_prompt = rng.randint(1, max_total_tokens - 1)
        seq = make_seq(f"s{i}", num_prompt, max_tokens=rng.randint(1, max_total_tokens - num_prompt))
        seqs.append(seq)
        arrivals.setdefault(rng.randint(0, 30), []).append(seq)
    return seqs, arrivals


@pytest.mark.parametrize(
    "num_blocks,max_num_seqs,max_num_batched_tokens,expect_preemption",
    [(256, 8, 64, False), (64, 6, 16, False), (12, 6, 8, True)],
    ids=["roomy", "chunked", "tight"],
)
@pytest.mark.parametrize("seed", [0, 1])
def test_full_run_finishes_every_sequence_exactly(seed, num_blocks, max_num_seqs, max_num_batched_tokens, expect_preemption):
    scheduler = make_scheduler(num_blocks, max_num_seqs, max_num_batched_tokens)
    # Every request fits the pool on its own, as the engine guarantees before queueing it.
    seqs, arrivals = random_arrivals(seed, num_seqs=20, max_total_tokens=min(40, num_blocks * BLOCK_SIZE))
    finished = simulate(scheduler, arrivals)
    assert sorted(seq.seq_id for seq in finished) == sorted(seq.seq_id for seq in seqs)
    for seq in seqs:
        assert seq.output_token_ids == [1000 + i for i in range(seq.params.max_tokens)]
        assert seq.is_finished
    assert (scheduler.num_preemptions > 0) == expect_preemption
    assert scheduler.num_preemptions == sum(seq.num_preemptions for seq in seqs)
    assert scheduler.allocator.num_free_blocks == num_blocks
    assert not scheduler.running and not scheduler.waiting
    scheduler.allocator.check_invariants()


def test_config_rejects_zero_sequences():
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1, got 0"):
        SchedulerConfig(max_num_seqs=0, max_num_batched_tokens=8)


def test_config_rejects_a_token_budget_below_one_decode_per_sequence():
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(3\) must be >= max_num_seqs \(4\)"):
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=3)


def test_each_chunk_carries_its_block_table_as_the_step_left_it():
    """The model runner reads the blocks from the chunks: after growth and preemption within the step."""
    scheduler = make_scheduler(num_blocks=3)
    a, b = make_seq("a", 4, max_tokens=8), make_seq("b", 4, max_tokens=8)
    scheduler.add(a)
    scheduler.add(b)
    first = schedule(scheduler)
    assert [c.block_table for c in first] == [[0], [1]]
    run_chunks(scheduler, first)
    # a's first output token fills its block: a grows into the last free block, then b cannot grow and is
    # preempted (the newest), so only a runs, in both of its blocks
    second = schedule(scheduler)
    assert scheduled(second) == [("a", 1)] and b.status is SequenceStatus.WAITING
    assert second[0].block_table == scheduler.allocator.block_table("a") == [0, 2]
