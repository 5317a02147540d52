"""EngineLoop on the tiny model, no Ray: concurrent streams, abort, move out with KV, resumed requests, step errors."""

import asyncio
import copy
import random

import pytest
import torch

from workers.engine.engine import Engine, EngineConfig
from workers.engine.engine_loop import EngineLoop, WorkEvent, WorkRequest
from workers.values.sampling_params import SamplingParams

BLOCK_SIZE = 4
BYTES_PER_BLOCK = 2 * 2 * BLOCK_SIZE * 2 * 16 * 4
TIMEOUT_S = 60


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


def make_engine(model: torch.nn.Module, num_blocks: int = 64, max_num_seqs: int = 4) -> Engine:
    config = EngineConfig.of(kv_cache_bytes=num_blocks * BYTES_PER_BLOCK, block_size=BLOCK_SIZE,
                          max_num_seqs=max_num_seqs, max_num_batched_tokens=16)
    return Engine(copy.deepcopy(model), config)


def make_request(request_id: str, num_prompt_tokens: int, max_tokens: int, seed: int, **kwargs) -> WorkRequest:
    rng = random.Random(seed)
    prompt = tuple(rng.randrange(256) for _ in range(num_prompt_tokens))
    return WorkRequest(request_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), **kwargs)


def expected_tokens(model: torch.nn.Module, request: WorkRequest) -> list[int]:
    return make_engine(model).generate([list(request.prompt_token_ids)], request.params)[0]


async def collect(loop: EngineLoop, request: WorkRequest) -> list[WorkEvent]:
    return [event async for event in loop.generate(request)]


def tokens_of(events: list[WorkEvent]) -> list[int]:
    return [token for event in events for token in event.token_ids]


def run(coro):
    async def bounded():
        return await asyncio.wait_for(coro, TIMEOUT_S)

    return asyncio.run(bounded())


async def wait_for_stats(loop: EngineLoop, predicate) -> None:
    for _ in range(400):
        if predicate(loop.stats()):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"stats never matched: {loop.stats()}")


def test_concurrent_streams_get_their_own_greedy_tokens(tiny_model):
    requests = [make_request(f"r{i}", 3 + 4 * i, 6 + 3 * i, seed=i) for i in range(5)]

    async def main():
        loop = EngineLoop(make_engine(tiny_model, max_num_seqs=3), "w0")
        results = await asyncio.gather(*(collect(loop, r) for r in requests))
        stats = loop.stats()
        await loop.close()
        return results, stats

    results, stats = run(main())
    for request, events in zip(requests, results):
        assert tokens_of(events) == expected_tokens(tiny_model, request)
        assert [e.finish_reason for e in events[:-1]] == [None] * (len(events) - 1)
        last = events[-1]
        assert last.finish_reason == "length" and last.num_output_tokens == request.params.max_tokens
        assert last.num_prompt_tokens == len(request.prompt_token_ids)
        assert [e.num_output_tokens for e in events] == sorted({e.num_output_tokens for e in events})
        metrics = last.metrics
        assert metrics.num_generated_tokens == request.params.max_tokens
        assert 0 <= metrics.ttft_s <= metrics.latency_s and metrics.tpot_s > 0
    assert stats.num_free_blocks == stats.num_total_blocks and stats.request_ids == ()
    assert stats.num_generated_tokens == sum(r.params.max_tokens for r in requests)
    assert stats.bytes_per_block == BYTES_PER_BLOCK and stats.num_steps > 0


def test_bad_input_raises_before_any_event_and_others_keep_running(tiny_model):
    good = make_request("good", 5, 12, seed=10)

    async def main():
        loop = EngineLoop(make_engine(tiny_model), "w0")
        stream = loop.generate(good)
        first = await anext(stream)
        with pytest.raises(ValueError, match="exceeds the context"):
            await anext(loop.generate(make_request("long", 500, 100, seed=11)))
        with pytest.raises(ValueError, match="prompt is empty"):
            await anext(loop.generate(WorkRequest("empty", (), SamplingParams(max_tokens=3))))
        with pytest.raises(ValueError, match="'good' is already in use"):
            await anext(loop.generate(make_request("good", 3, 3, seed=12)))
        rest = [event async for event in stream]
        ids = loop.stats().request_ids
        await loop.close()
        return [first, *rest], ids

    events, ids = run(main())
    assert tokens_of(events) == expected_tokens(tiny_model, good)
    assert ids == ()


def test_an_id_taken_while_a_moved_request_fetches_its_kv_is_refused_to_the_later_one(tiny_model):
    first, second = make_request("same", 5, 6, seed=13), make_request("same", 4, 200, seed=14)

    async def main():
        loop = EngineLoop(make_engine(tiny_model), "w0")
        kv_arrives = asyncio.Event()

        async def lost_kv():  # the exporter is gone: the moved request recomputes
            await kv_arrives.wait()
            raise ConnectionError("exporter died")

        moved = asyncio.ensure_future(collect(loop, WorkRequest(first.request_id, first.prompt_token_ids,
                                                                first.params, kv=lost_kv())))
        await asyncio.sleep(0.05)  # the moved request is past the id check, waiting for its KV
        served = asyncio.ensure_future(collect(loop, second))
        await asyncio.sleep(0.01)  # the later one holds the id (it runs for 200 tokens)
        kv_arrives.set()
        with pytest.raises(ValueError, match="'same' is already in use"):
            await moved
        events = await asyncio.wait_for(served, 10)  # before the fix its stream was lost and it waited forever
        await loop.close()
        return events

    events = run(main())
    assert events[-1].finish_reason == "length" and tokens_of(events) == expected_tokens(tiny_model, second)


def test_abort_ends_the_stream_and_frees_its_blocks(tiny_model):
    async def main():
        loop = EngineLoop(make_engine(tiny_model), "w0")
        stream = loop.generate(make_request("a", 9, 100, seed=20))
        first = await anext(stream)
        assert loop.stats().num_reserved_blocks > 0
        assert loop.abort("a")
        assert not loop.abort("a")  # already ending
        assert not loop.abort("unknown")
        rest = [event async for event in stream]
        await wait_for_stats(loop, lambda s: s.num_steps > 0 and s.request_ids == ())
        stats = loop.stats()
        await loop.close()
        return first, rest, stats

    first, rest, stats = run(main())
    assert first.finish_reason is None
    assert rest[-1].finish_reason == "abort" and rest[-1].num_output_tokens < 100
    assert stats.num_free_blocks == stats.num_total_blocks and stats.num_running == 0


def test_a_consumer_that_leaves_aborts_its_request(tiny_model):
    async def main():
        loop = EngineLoop(make_engine(tiny_model), "w0")
        closed = loop.generate(make_request("closed", 6, 100, seed=30))
        await anext(closed)
        await closed.aclose()  # GeneratorExit at the yield

        async def consume_forever():
            async for _ in loop.generate(make_request("cancelled", 6, 100, seed=31)):
                pass

        task = asyncio.create_task(consume_forever())
        await wait_for_stats(loop, lambda s: "cancelled" in s.request_ids)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_for_stats(loop, lambda s: s.request_ids == ())
        stats = loop.stats()
        await loop.close()
        return stats

    stats = run(main())
    assert stats.num_free_blocks == stats.num_total_blocks


@pytest.mark.parametrize("with_kv", [True, False], ids=["kv", "recompute"])
def test_moved_sequence_continues_on_another_loop_with_the_same_greedy_tokens(tiny_model, with_kv):
    request = make_request("m", 7, 20, seed=40)

    async def main():
        source, target = EngineLoop(make_engine(tiny_model), "w0"), EngineLoop(make_engine(tiny_model), "w1")
        stream = source.generate(request)
        before = [await anext(stream), await anext(stream)]
        assert source.move_out("m", "w1", with_kv=with_kv)
        before += [event async for event in stream]
        moved = before[-1]
        resumed = WorkRequest(request.request_id, request.prompt_token_ids, request.params,
                              resumed_output_token_ids=tuple(tokens_of(before)), kv=moved.kv)
        after = await collect(target, resumed)
        source_stats, target_stats = source.stats(), target.stats()
        await source.close()
        await target.close()
        return before, after, source_stats, target_stats

    before, after, source_stats, target_stats = run(main())
    moved = before[-1]
    assert (moved.finish_reason, moved.moved_to, moved.token_ids) == ("moved", "w1", ())
    sent = tokens_of(before)
    assert 2 <= len(sent) < 20 and moved.num_output_tokens == len(sent)
    if with_kv:
        assert moved.kv.num_computed_tokens == len(request.prompt_token_ids) + len(sent) - 1
    else:
        assert moved.kv is None
    assert sent + tokens_of(after) == expected_tokens(tiny_model, request)
    assert after[-1].num_output_tokens == 20 and after[-1].metrics.num_generated_tokens == 20 - len(sent)
    assert source_stats.num_migrated_out == 1 and target_stats.num_migrated_in == 1
    assert source_stats.num_free_blocks == source_stats.num_total_blocks


def test_a_failing_step_fails_its_requests_and_the_loop_serves_the_rest(tiny_model):
    engine = make_engine(tiny_model, max_num_seqs=1)
    forward = engine.runner.run

    def forward_failing_on_bad(chunks, **options):
        if any(chunk.seq.seq_id == "bad" for chunk in chunks):
            raise RuntimeError("injected kernel failure")
        return forward(chunks, **options)

    engine.runner.run = forward_failing_on_bad
    queued, later = make_request("queued", 5, 6, seed=51), make_request("later", 4, 5, seed=52)

    async def main():
        loop = EngineLoop(engine, "w0")
        # Both arrive in the same tick; one sequence runs at a time, so "queued" waits outside the failing step.
        bad = asyncio.create_task(collect(loop, make_request("bad", 6, 8, seed=50)))
        waiting = asyncio.create_task(collect(loop, queued))
        bad_events = await bad
        results = await asyncio.gather(waiting, collect(loop, later))
        stats = loop.stats()
        await loop.close()
        return bad_events, results, stats

    bad_events, (queued_events, later_events), stats = run(main())
    assert bad_events[-1].finish_reason == "error"
    assert "RuntimeError: injected kernel failure" in bad_events[-1].error
    assert tokens_of(queued_events) == expected_tokens(tiny_model, queued)
    assert tokens_of(later_events) == expected_tokens(tiny_model, later)
    assert stats.num_free_blocks == stats.num_total_blocks


def test_a_request_the_engine_cannot_drop_ends_in_error_and_the_loop_serves_the_rest(tiny_model):
    """A tensor-parallel engine whose ranks fell out of step refuses to drop a request; moving it out must then
    end its stream with the error (not leave it open, nor stop the step thread)."""
    engine = make_engine(tiny_model)
    abort = engine.abort

    def abort_refusing_stuck(seq_id):
        if seq_id == "stuck":
            raise RuntimeError("the tensor-parallel ranks are out of step")
        return abort(seq_id)

    engine.abort = abort_refusing_stuck
    other = make_request("other", 5, 12, seed=61)

    async def main():
        loop = EngineLoop(engine, "w0")
        stream = loop.generate(make_request("stuck", 6, 40, seed=60))
        first = await anext(stream)
        others = asyncio.create_task(collect(loop, other))
        assert loop.move_out("stuck", "w1", with_kv=True)
        stuck_events = [first] + [event async for event in stream]
        other_events = await others
        await loop.close()
        return stuck_events, other_events

    stuck_events, other_events = run(main())
    assert stuck_events[-1].finish_reason == "error" and stuck_events[-1].moved_to is None
    assert "dropping the request failed: RuntimeError: the tensor-parallel ranks are out of step" in \
        stuck_events[-1].error
    assert tokens_of(other_events) == expected_tokens(tiny_model, other)


def test_close_aborts_open_streams(tiny_model):
    async def main():
        loop = EngineLoop(make_engine(tiny_model), "w0")
        stream = loop.generate(make_request("open", 5, 100, seed=60))
        await anext(stream)
        await loop.close()
        rest = [event async for event in stream]
        with pytest.raises(RuntimeError, match="closed"):
            await anext(loop.generate(make_request("late", 5, 4, seed=61)))
        return rest

    rest = run(main())
    assert rest[-1].finish_reason == "abort"


def test_stats_report_preempted_sequences_as_overruns(tiny_model):
    from workers.scheduling.policies import make_policy

    engine = Engine(copy.deepcopy(tiny_model),
                    EngineConfig.of(kv_cache_bytes=6 * BYTES_PER_BLOCK, block_size=BLOCK_SIZE, max_num_seqs=4,
                                 max_num_batched_tokens=16, preemption_mode="recompute"),
                    policy=make_policy("s3", bucket_tokens=4))
    requests = [make_request(f"r{i}", 6, 12, seed=70 + i, predicted_output_tokens=2) for i in range(2)]

    async def main():
        loop = EngineLoop(engine, "w0")
        tasks = [asyncio.create_task(collect(loop, r)) for r in requests]
        seen = []
        while not all(t.done() for t in tasks):
            seen.extend(loop.stats().overruns)
            await asyncio.sleep(0.001)
        results = [t.result() for t in tasks]
        stats = loop.stats()
        await loop.close()
        return seen, results, stats

    seen, results, stats = run(main())
    assert seen, "no overrun was reported"
    report = seen[0]
    assert report.predicted_output_tokens > 2 and report.num_output_tokens > 2
    assert report.num_blocks_needed == -(-(6 + report.predicted_output_tokens) // BLOCK_SIZE)
    assert stats.num_overruns > 0 and stats.num_preemptions > 0 and stats.overruns == ()
    for request, events in zip(requests, results):
        assert tokens_of(events) == expected_tokens(tiny_model, request)
