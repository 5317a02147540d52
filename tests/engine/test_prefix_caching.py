"""Prefix caching in the engine, on the tiny random Llama: same greedy tokens as without it, less computed,
shared blocks safe under abort, preemption (swap and recompute) and moves between engines."""

import copy
import random

import pytest

from workers.engine.engine import Engine, EngineConfig
from workers.scheduling.policies import make_policy
from workers.values.sampling_params import SamplingParams

BLOCK_SIZE = 4
BYTES_PER_BLOCK = 2 * 2 * BLOCK_SIZE * 2 * 16 * 4  # K and V, 2 layers, 2 kv heads, head_dim 16, fp32
PREFIX = [random.Random(7).randrange(256) for _ in range(24)]  # 6 full blocks, e.g. a system prompt


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def engine(model, caching: bool, num_blocks: int = 64, policy=None, max_num_seqs: int = 4,
           preemption_mode: str = "auto") -> Engine:
    config = EngineConfig.of(kv_cache_bytes=num_blocks * BYTES_PER_BLOCK, block_size=BLOCK_SIZE,
                          max_num_seqs=max_num_seqs, max_num_batched_tokens=64, prefix_caching=caching,
                          preemption_mode=preemption_mode)
    return Engine(copy.deepcopy(model), config, policy=policy)


def suffix(seed: int, length: int = 5) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(length)]


def run_all(eng: Engine, max_steps: int = 600, metrics: dict | None = None) -> dict[str, list[int]]:
    outputs = {}
    for _ in range(max_steps):
        if not eng.has_unfinished():
            return outputs
        for out in eng.step():
            if out.is_finished:
                outputs[out.seq_id] = list(out.output_token_ids)
                if metrics is not None:
                    metrics[out.seq_id] = out.metrics
    raise AssertionError("the engine did not finish")


def assert_nothing_held(eng: Engine) -> None:
    assert not eng.has_unfinished()
    assert eng.allocator.num_free_blocks == eng.allocator.num_blocks  # cached blocks are free to take
    eng.allocator.check_invariants()


def test_a_shared_prefix_gives_the_same_tokens_and_the_second_request_computes_only_its_new_tokens(tiny_model):
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    first, second = PREFIX + suffix(1), PREFIX + suffix(2)
    results, metrics = {}, {}
    for caching in (False, True):
        eng = engine(tiny_model, caching)
        eng.add_request(first, params, seq_id="first")
        outputs = run_all(eng, metrics=metrics)
        eng.add_request(second, params, seq_id="second")
        eng.step()
        computed_in_first_step = eng.last_times.num_tokens
        outputs.update(run_all(eng, metrics=metrics))
        results[caching] = (outputs, computed_in_first_step, eng.scheduler.stats)
        assert_nothing_held(eng)
    assert results[True][0] == results[False][0]
    assert results[False][1] == len(second)
    assert results[True][1] == len(second) - len(PREFIX)  # the prefix's 6 blocks came from the cache
    stats = results[True][2]
    assert stats.num_prefix_hit_tokens == len(PREFIX)
    assert stats.num_prompt_tokens_admitted == len(first) + len(second)
    # what usage.prompt_tokens_details.cached_tokens reports
    assert (metrics["first"].num_cached_prompt_tokens, metrics["second"].num_cached_prompt_tokens) == (0, len(PREFIX))


def test_shared_blocks_survive_the_abort_of_the_request_that_computed_them(tiny_model):
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    expected = run_all(_with(engine(tiny_model, False), "b", PREFIX + suffix(3), params))["b"]
    eng = engine(tiny_model, True)
    eng.add_request(PREFIX + suffix(4), params, seq_id="a")
    eng.step()  # a's prompt is computed and its full blocks named
    eng.add_request(PREFIX + suffix(3), params, seq_id="b")
    eng.step()  # b shares them
    assert eng.allocator.block_table("b")[:6] == eng.allocator.block_table("a")[:6]
    assert eng.abort("a")
    assert run_all(eng)["b"] == expected
    assert_nothing_held(eng)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preempted_requests_sharing_a_prefix_keep_their_tokens(tiny_model, mode):
    prompts = {f"r{i}": PREFIX + suffix(10 + i, 1 + 2 * i) for i in range(5)}
    lengths = {f"r{i}": 8 + 4 * i for i in range(5)}
    results = {}
    for caching in (False, True):
        # Room for the prefix plus a few blocks each: predictions of 2 tokens make everyone overrun.
        eng = engine(tiny_model, caching, num_blocks=22, max_num_seqs=5,
                     policy=make_policy("s3", bucket_tokens=4), preemption_mode=mode)
        for seq_id, prompt in prompts.items():
            eng.add_request(prompt, SamplingParams(max_tokens=40, forced_output_tokens=lengths[seq_id]),
                            seq_id=seq_id, predicted_output_tokens=2)
        results[caching] = run_all(eng)
        if caching:
            stats = eng.scheduler.stats
            assert stats.num_preemptions > 0 and stats.num_prefix_hit_tokens >= 2 * len(PREFIX)
            assert (eng.swapped_bytes > 0) == (mode == "swap")
        assert_nothing_held(eng)
    assert results[True] == results[False]


def test_a_request_moved_between_caching_engines_continues_with_the_same_tokens(tiny_model):
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    prompt = PREFIX + suffix(5)
    expected = run_all(_with(engine(tiny_model, False), "m", prompt, params))["m"]
    source, target = engine(tiny_model, True), engine(tiny_model, True)
    run_all(_with(target, "warm", PREFIX + suffix(6), SamplingParams(max_tokens=2, ignore_eos=True)))
    source.add_request(prompt, params, seq_id="m")
    outputs = []
    for _ in range(4):
        outputs += [out.token_id for out in source.step()]
    kv = source.export_sequence("m")
    assert source.abort("m")
    target.add_request(prompt, params, seq_id="m", resumed_output_token_ids=outputs, kv=kv)
    assert run_all(target)["m"] == expected
    assert_nothing_held(source)
    assert_nothing_held(target)


def _with(eng: Engine, seq_id: str, prompt: list[int], params: SamplingParams) -> Engine:
    eng.add_request(prompt, params, seq_id=seq_id)
    return eng


# --- priority classes ----------------------------------------------------------------------------


def test_an_urgent_request_under_memory_pressure_preempts_a_less_urgent_one_never_the_reverse(tiny_model):
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    expected = {}
    for seq_id, seed in (("batch", 20), ("urgent", 21)):
        expected[seq_id] = run_all(_with(engine(tiny_model, False), seq_id, suffix(seed, 10), params))[seq_id]
    # 12 blocks of 4 tokens: one request (10 + 30 tokens) fits, not two.
    eng = engine(tiny_model, True, num_blocks=12, policy=make_policy("max_reserve"))
    eng.add_request(suffix(20, 10), params, seq_id="batch", priority=5)
    eng.step()
    eng.add_request(suffix(21, 10), params, seq_id="urgent", priority=0)
    eng.step()
    assert [s.seq_id for s in eng.scheduler.running] == ["urgent"]  # batch gave its blocks up
    assert eng.sequence("batch").num_preemptions == 1
    assert run_all(eng) == expected  # both still produce exactly their tokens
    assert_nothing_held(eng)

    # The reverse: a less urgent arrival waits; the running urgent request keeps its blocks.
    eng = engine(tiny_model, True, num_blocks=12, policy=make_policy("max_reserve"))
    eng.add_request(suffix(21, 10), params, seq_id="urgent", priority=0)
    eng.step()
    eng.add_request(suffix(20, 10), params, seq_id="batch", priority=5)
    for _ in range(5):
        eng.step()
        assert [s.seq_id for s in eng.scheduler.running] == ["urgent"]
    assert eng.sequence("urgent").num_preemptions == 0
    assert run_all(eng) == expected


@pytest.mark.parametrize("policy_name", ["paged_greedy", "s3"])
def test_growth_preempts_the_least_urgent_class_first(tiny_model, policy_name):
    # Three on-demand sequences outgrow 14 blocks; the priority-9 one must be the one that yields.
    eng = engine(tiny_model, True, num_blocks=14,
                 policy=make_policy(policy_name, **({"bucket_tokens": 4} if policy_name == "s3" else {})))
    for index, priority in enumerate((0, 9, 3)):
        eng.add_request(suffix(30 + index, 6), SamplingParams(max_tokens=30, ignore_eos=True), seq_id=f"p{priority}",
                        priority=priority, predicted_output_tokens=2)
    first_victim = None
    for _ in range(200):
        if not eng.has_unfinished():
            break
        before = {s.seq_id: s.num_preemptions for s in (*eng.scheduler.running, *eng.scheduler.waiting)}
        eng.step()
        for seq_id, count in before.items():
            seq = eng.sequence(seq_id)
            if first_victim is None and seq is not None and seq.num_preemptions > count:
                first_victim = seq_id
    assert first_victim == "p9"
    assert_nothing_held(eng)


def test_a_priority_that_is_not_an_integer_is_refused(tiny_model):
    eng = engine(tiny_model, True)
    with pytest.raises(ValueError, match="priority must be an integer"):
        eng.add_request([1, 2, 3], SamplingParams(max_tokens=2), priority="high")
    assert not eng.has_unfinished()


@pytest.mark.parametrize("policy_name", ["paged_greedy", "s3"])
def test_an_urgent_sequence_admitted_later_grows_at_the_expense_of_an_earlier_less_urgent_one(tiny_model,
                                                                                          policy_name):
    # "batch" runs first, "urgent" joins; 9 blocks cannot hold both to the end, so growth must take from batch
    # (already running, earlier in the running list) within one step, and both still produce exact tokens.
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    prompts = {"batch": suffix(40, 6), "urgent": suffix(41, 6)}
    expected = {seq_id: run_all(_with(engine(tiny_model, False), seq_id, prompt, params))[seq_id]
                for seq_id, prompt in prompts.items()}
    kwargs = {"bucket_tokens": 4} if policy_name == "s3" else {}
    eng = engine(tiny_model, True, num_blocks=9, policy=make_policy(policy_name, **kwargs))
    eng.add_request(prompts["batch"], params, seq_id="batch", priority=5, predicted_output_tokens=2)
    eng.step()
    eng.add_request(prompts["urgent"], params, seq_id="urgent", priority=0, predicted_output_tokens=2)
    outputs, batch_preempted = {}, False
    for _ in range(300):
        if not eng.has_unfinished():
            break
        for out in eng.step():
            assert out.finish_reason != "error"
            if out.is_finished:
                outputs[out.seq_id] = list(out.output_token_ids)
        urgent, batch = eng.sequence("urgent"), eng.sequence("batch")
        assert urgent is None or urgent.num_preemptions == 0  # never the urgent one
        batch_preempted = batch_preempted or (batch is not None and batch.num_preemptions > 0)
    assert batch_preempted and outputs == expected
    assert_nothing_held(eng)


def test_a_router_computes_the_hashes_its_workers_report(tiny_model):
    from workers.scheduling.prefix_cache import block_hashes, prefix_cache_salt, salt_hash
    from workers.values.work_types import MAX_REPORTED_PREFIX_HASHES

    salt = prefix_cache_salt("smollm2-135m-instruct", "auto")  # what router and worker settings both build
    config = EngineConfig.of(kv_cache_bytes=64 * BYTES_PER_BLOCK, block_size=BLOCK_SIZE, max_num_batched_tokens=64,
                          cache_salt=salt)
    eng = Engine(copy.deepcopy(tiny_model), config)
    prompt = PREFIX + suffix(8)
    run_all(_with(eng, "r", prompt, SamplingParams(max_tokens=3, ignore_eos=True)))
    reported = set(eng.allocator.cache.recent_hashes(MAX_REPORTED_PREFIX_HASHES))
    router_side = block_hashes(prompt, BLOCK_SIZE, salt_hash(salt))
    assert len(router_side) == 7 and set(router_side) <= reported
    assert not set(block_hashes(prompt, BLOCK_SIZE, salt_hash(prefix_cache_salt("other-model", "auto")))) & reported


def test_requests_arriving_together_compute_a_shared_prefix_once(tiny_model):
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    prompts = {"a": PREFIX + suffix(50), "b": PREFIX + suffix(51), "c": suffix(52, 30)}
    results = {}
    for caching in (False, True):
        eng = engine(tiny_model, caching)
        for seq_id, prompt in prompts.items():
            eng.add_request(prompt, params, seq_id=seq_id)
        eng.step()
        first_step = {s.seq_id for s in eng.scheduler.running}
        results[caching] = (run_all(eng), first_step, eng.scheduler.stats.num_prefix_hit_tokens)
        assert_nothing_held(eng)
    assert results[True][0] == results[False][0]
    assert results[False][1] == {"a", "b", "c"}
    assert results[True][1] == {"a", "c"}  # b waits one step for a's prefix instead of computing it too
    assert results[True][2] == len(PREFIX)
