"""One engine over two ranks (gloo on CPU, DeepSpeed AutoTP in each): the same tokens and the same
scheduling as one rank, swaps included; the same exported KV, so a request moves onto or off it with its
KV; no shared-memory files left behind; and the clear errors when the ranks are not there."""

import multiprocessing
from pathlib import Path

import pytest
import torch

from workers.actors.ports import free_port
from workers.engine.engine import Engine, EngineConfig
from workers.engine.model_runner import pool_shape_for
from workers.engine.models import make_tiny_model, tiny_llama_config
from workers.scheduling.s3_policy import S3Policy
from workers.values.sampling_params import SamplingParams

BLOCK_SIZE = 4
NUM_BLOCKS = 24  # six requests of up to 44 tokens: they must take turns, and preempted ones swap
PROMPTS = [[(7 * i + 3 * j) % 250 + 3 for j in range(8 + 3 * i)] for i in range(6)]
PARAMS = SamplingParams(max_tokens=20, ignore_eos=True)


def _policy() -> S3Policy:
    # Bounds of 4 tokens undershoot every answer (every preemption swaps: `_config`'s preemption_mode).
    return S3Policy(bucket_tokens=4)


def _config(tensor_parallel_size: int) -> EngineConfig:
    shape = pool_shape_for(tiny_llama_config(), 1, BLOCK_SIZE, torch.float32, tensor_parallel_size)
    return EngineConfig.of(kv_cache_bytes=NUM_BLOCKS * shape.bytes_per_block, block_size=BLOCK_SIZE,
                        tensor_parallel_size=tensor_parallel_size, use_fast_path=False, preemption_mode="swap")


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

    torch.set_num_threads(1)
    from workers.actors.rank_group import join_ranks
    from workers.engine.tensor_parallel import follow_engine

    join_ranks(rank, 2, "127.0.0.1", port, "cpu")
    model = make_tiny_model(seed=0, init_std=0.2)
    if rank != 0:
        results.put((rank, {"calls": follow_engine(model)}))
        return
    engine = Engine(model, _config(2), policy=_policy())
    try:
        tokens = _generate(engine)
        stats = engine.scheduler.stats
        swaps, preemptions = stats.num_swaps, stats.num_preemptions
        exports = _compare_exports(engine)
        # A move in: KV exported by a one-rank engine is split across the ranks and copied in, not recomputed.
        source = Engine(make_tiny_model(seed=0, init_std=0.2), _config(1))
        source_id = source.add_request(PROMPTS[1], PARAMS)
        for _ in range(3):
            source.step()
        kv = source.export_sequence(source_id)
        copied_before = engine.swapped_bytes
        engine.add_request(PROMPTS[1], PARAMS, seq_id="moved-in", kv=kv,
                           resumed_output_token_ids=list(source.sequence(source_id).output_token_ids))
        moved_in = _finish(engine, "moved-in")
        imported = {"kv_tokens": kv.num_computed_tokens, "copied_bytes": engine.swapped_bytes - copied_before,
                    "tokens": moved_in}
        # A move out: the ranks' heads joined into one copy, which a one-rank engine continues from.
        engine.add_request(PROMPTS[0], PARAMS, seq_id="moved-out")
        for _ in range(4):
            engine.step()
        kv = engine.export_sequence("moved-out")
        target = Engine(make_tiny_model(seed=0, init_std=0.2), _config(1))
        target.add_request(PROMPTS[0], PARAMS, seq_id="moved-out", kv=kv,
                           resumed_output_token_ids=list(engine.sequence("moved-out").output_token_ids))
        engine.abort("moved-out")
        exported = {"kv_tokens": kv.num_computed_tokens, "tokens": _finish(target, "moved-out"),
                    "copied_bytes": target.swapped_bytes}
    finally:
        engine.close()
    results.put((0, {"tokens": tokens, "swaps": swaps, "preemptions": preemptions,
                     "num_blocks": engine.allocator.num_blocks, "kv_heads": engine.runner.pool_shape.num_kv_heads,
                     "path": engine.runner.path, "calls": engine.runner.num_calls_sent,
                     "exports": exports, "exported": exported, "imported": imported}))


def _finish(engine: Engine, seq_id: str) -> list[int]:
    tokens = None
    while engine.has_unfinished():
        tokens = next((list(o.output_token_ids) for o in engine.step() if o.is_finished and o.seq_id == seq_id),
                      tokens)
    return tokens


def _tokens(blocks: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[num_blocks, block_size, heads, head_dim] -> the first `num_tokens` tokens, [num_tokens, heads, head_dim]."""
    return blocks.reshape(-1, *blocks.shape[2:])[:num_tokens]


def _compare_exports(engine: Engine) -> dict:
    """Step the two-rank engine and a one-rank one in lock-step (they schedule alike) and compare every live
    sequence's export after each step: the joined heads must equal what one rank holding them all exports."""
    reference = Engine(make_tiny_model(seed=0, init_std=0.2), _config(1), policy=_policy())
    for i, prompt in enumerate(PROMPTS):
        for e in (engine, reference):
            e.add_request(prompt, PARAMS, seq_id=f"x{i}", predicted_output_tokens=4)
    compared = {"running": 0, "swapped": 0, "max_abs_diff": 0.0, "token_counts_differ": 0}
    while reference.has_unfinished():
        engine.step()
        reference.step()
        for seq_id in [f"x{i}" for i in range(len(PROMPTS))]:
            try:
                expected = reference.export_sequence(seq_id)
            except ValueError:
                continue  # finished
            got = engine.export_sequence(seq_id)
            if got.num_computed_tokens != expected.num_computed_tokens or not expected.num_computed_tokens:
                compared["token_counts_differ"] += got.num_computed_tokens != expected.num_computed_tokens
                continue
            compared["swapped" if reference.sequence(seq_id).is_swapped else "running"] += 1
            num_tokens = got.num_computed_tokens  # the last block's tail past them is garbage in either pool
            for got_kv, expected_kv in zip(got.layers, expected.layers):
                for tensor, reference_tensor in zip(got_kv, expected_kv):  # K, then V
                    diff = (_tokens(tensor, num_tokens) - _tokens(reference_tensor, num_tokens)).abs().max().item()
                    compared["max_abs_diff"] = max(compared["max_abs_diff"], diff)
    return compared


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
def test_two_ranks_give_one_ranks_tokens_schedule_and_exported_kv_and_moves_copy_their_kv():
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
    # DeepSpeed's CPU allreduce buffers (one per rank in /dev/shm, about 70 MB each) are not left behind.
    assert not list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_127.0.0.1_{port}_*"))
    assert all(len(tokens) == PARAMS.max_tokens for tokens in expected)
    # The same blocks as one rank, each holding half the KV heads; the same scheduling, swaps included.
    assert lead["num_blocks"] == reference.allocator.num_blocks == NUM_BLOCKS
    assert lead["kv_heads"] == reference.runner.pool_shape.num_kv_heads // 2
    assert lead["swaps"] == reference.scheduler.stats.num_swaps > 0
    assert lead["preemptions"] == reference.scheduler.stats.num_preemptions
    assert lead["path"] == "hf"
    # The follower made every call rank 0 sent (forwards, swaps, drops), and stopped when it closed.
    assert follower["calls"] == lead["calls"] > reference.num_steps
    # Exports join the ranks' heads into what one rank holding them all exports, swapped sequences included.
    exports = lead["exports"]
    assert exports["token_counts_differ"] == 0
    assert exports["running"] > 0 and exports["swapped"] > 0
    assert exports["max_abs_diff"] < 1e-4  # float32; the ranks' all-reduce sums in another order
    # Moves in both directions copy the KV instead of recomputing it, and the answers are unchanged.
    imported, exported = lead["imported"], lead["exported"]
    assert imported["kv_tokens"] > 0 and imported["copied_bytes"] > 0
    assert imported["tokens"] == expected[1]
    assert exported["kv_tokens"] > len(PROMPTS[0]) and exported["copied_bytes"] > 0
    assert exported["tokens"] == expected[0]


def test_tensor_parallel_needs_the_ranks_running_and_heads_that_split():
    with pytest.raises(ValueError, match="needs torch.distributed running that many ranks.*follow_engine"):
        Engine(make_tiny_model(seed=0), _config(2))
    with pytest.raises(ValueError, match="must divide the model's 6 attention heads and 2 KV heads"):
        pool_shape_for(tiny_llama_config(), 1, BLOCK_SIZE, torch.float32, 4)
    assert pool_shape_for(tiny_llama_config(), 1, BLOCK_SIZE, torch.float32, 2).num_kv_heads == 1


def test_splitting_a_host_copy_by_heads_and_joining_it_back_is_exact():
    from workers.engine.tensor_parallel import join_heads, split_heads

    generator = torch.Generator().manual_seed(0)
    layers = [(torch.randn(3, BLOCK_SIZE, 4, 8, generator=generator),
               torch.randn(3, BLOCK_SIZE, 4, 8, generator=generator)) for _ in range(2)]  # 4 KV heads
    shares = split_heads(layers, 2)
    assert [k.shape for k, _ in shares[1]] == [torch.Size([3, BLOCK_SIZE, 2, 8])] * 2
    assert torch.equal(shares[1][0][1], layers[0][1][:, :, 2:])  # rank 1 holds the second half of the heads
    joined = join_heads(shares)
    assert all(torch.equal(k, k0) and torch.equal(v, v0) for (k, v), (k0, v0) in zip(joined, layers))
