"""One engine over two ranks (gloo on CPU, DeepSpeed AutoTP in each): the same tokens and the same
scheduling as one rank, swaps included; and the clear errors when the ranks are not there."""

import multiprocessing

import pytest
import torch

from workers.engine import Engine, EngineConfig
from workers.model_runner import pool_shape_for
from workers.models import make_tiny_model, tiny_llama_config
from workers.policies import PreemptionCostModel, S3Policy
from workers.sampling_params import SamplingParams
from workers.ports import free_port

BLOCK_SIZE = 4
NUM_BLOCKS = 24  # six requests of up to 44 tokens: they must take turns, and preempted ones swap
PROMPTS = [[(7 * i + 3 * j) % 250 + 3 for j in range(8 + 3 * i)] for i in range(6)]
PARAMS = SamplingParams(max_tokens=20, ignore_eos=True)


def _policy() -> S3Policy:
    # Bounds of 4 tokens undershoot every answer; copying is free, so every preemption swaps.
    return S3Policy(bucket_tokens=4, cost_model=PreemptionCostModel(prefill_s_per_token=1.0, swap_bytes_per_s=1e18))


def _config(tensor_parallel_size: int) -> EngineConfig:
    shape = pool_shape_for(tiny_llama_config(), 1, BLOCK_SIZE, torch.float32, tensor_parallel_size)
    return EngineConfig(kv_cache_bytes=NUM_BLOCKS * shape.bytes_per_block, block_size=BLOCK_SIZE,
                        tensor_parallel_size=tensor_parallel_size, use_fast_path=False)


def _generate(engine: Engine) -> list[list[int]]:
    ids = [engine.add_request(prompt, PARAMS, predicted_output_tokens=4) for prompt in PROMPTS]
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.is_finished:
                outputs[out.seq_id] = list(out.output_token_ids)
    return [outputs[seq_id] for seq_id in ids]


def _rank(rank: int, port: int, results) -> None:
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), LOCAL_SIZE="2")
    torch.set_num_threads(1)
    import deepspeed

    from workers.tensor_parallel import follow_engine

    deepspeed.init_distributed(dist_backend="gloo")
    model = make_tiny_model(seed=0, init_std=0.2)
    if rank != 0:
        results.put((rank, {"calls": follow_engine(model)}))
        return
    engine = Engine(model, _config(2), policy=_policy())
    try:
        tokens = _generate(engine)
        stats = engine.scheduler.stats
        swaps, preemptions, swapped_bytes = stats.num_swaps, stats.num_preemptions, engine.swapped_bytes
        # A move: nothing to export (rank 0 holds half the heads), and KV from elsewhere is recomputed.
        seq_id = engine.add_request(PROMPTS[0], PARAMS)
        engine.step()
        exported = engine.export_sequence(seq_id).num_computed_tokens
        engine.abort(seq_id)
        source = Engine(make_tiny_model(seed=0, init_std=0.2), _config(1))
        source_id = source.add_request(PROMPTS[1], PARAMS)
        for _ in range(3):
            source.step()
        kv = source.export_sequence(source_id)
        engine.add_request(PROMPTS[1], PARAMS, seq_id="moved", kv=kv,
                           resumed_output_token_ids=list(source.sequence(source_id).output_token_ids))
        moved = None
        while engine.has_unfinished():
            moved = next((list(o.output_token_ids) for o in engine.step() if o.is_finished), moved)
        imported = {"kv_tokens": kv.num_computed_tokens, "copied_bytes": engine.swapped_bytes - swapped_bytes,
                    "tokens": moved}
    finally:
        engine.close()
    results.put((0, {"tokens": tokens, "swaps": swaps, "preemptions": preemptions,
                     "num_blocks": engine.allocator.num_blocks, "kv_heads": engine.runner.pool_shape.num_kv_heads,
                     "path": engine.runner.path, "calls": engine.runner.num_calls_sent,
                     "exported": exported, "imported": imported}))


def _collect(ranks, results, timeout_s: float = 600) -> dict:
    """Each rank's answer; fails at once, with the exit codes, if a rank dies without one."""
    import queue
    import time

    answers, deadline = {}, time.monotonic() + timeout_s
    while len(answers) < len(ranks) and time.monotonic() < deadline:
        try:
            rank, answer = results.get(timeout=1)
            answers[rank] = answer
        except queue.Empty:
            dead = [p.exitcode for p in ranks if p.exitcode not in (None, 0)]
            assert not dead, f"a rank died without answering (exit codes {[p.exitcode for p in ranks]})"
    assert len(answers) == len(ranks), f"ranks answered {sorted(answers)} within {timeout_s} s"
    return answers


@pytest.mark.slow
def test_two_ranks_give_one_ranks_tokens_and_schedule_with_swaps_included():
    reference = Engine(make_tiny_model(seed=0, init_std=0.2), _config(1), policy=_policy())
    expected = _generate(reference)
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = free_port()
    ranks = [context.Process(target=_rank, args=(rank, port, results)) for rank in range(2)]
    for process in ranks:
        process.start()
    try:
        answers = _collect(ranks, results)
    finally:
        for process in ranks:
            process.join(timeout=60)
            if process.is_alive():
                process.kill()
    lead, follower = answers[0], answers[1]
    assert lead["tokens"] == expected
    assert all(len(tokens) == PARAMS.max_tokens for tokens in expected)
    # The same blocks as one rank, each holding half the KV heads; the same scheduling, swaps included.
    assert lead["num_blocks"] == reference.allocator.num_blocks == NUM_BLOCKS
    assert lead["kv_heads"] == reference.runner.pool_shape.num_kv_heads // 2
    assert lead["swaps"] == reference.scheduler.stats.num_swaps > 0
    assert lead["preemptions"] == reference.scheduler.stats.num_preemptions
    assert lead["path"] == "hf"
    # The follower made every call rank 0 sent (forwards, swaps, drops), and stopped when it closed.
    assert follower["calls"] == lead["calls"] > reference.num_steps
    # A moved request: rank 0 exports nothing; KV that comes with one is recomputed, not copied in.
    assert lead["exported"] == 0
    imported = lead["imported"]
    assert imported["kv_tokens"] > 0 and imported["copied_bytes"] == 0
    assert imported["tokens"] == expected[1]


def test_tensor_parallel_needs_the_ranks_running_and_heads_that_split():
    with pytest.raises(ValueError, match="needs torch.distributed running that many ranks.*follow_engine"):
        Engine(make_tiny_model(seed=0), _config(2))
    with pytest.raises(ValueError, match="must divide the model's 6 attention heads and 2 KV heads"):
        pool_shape_for(tiny_llama_config(), 1, BLOCK_SIZE, torch.float32, 4)
    assert pool_shape_for(tiny_llama_config(), 1, BLOCK_SIZE, torch.float32, 2).num_kv_heads == 1
