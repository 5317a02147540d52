"""Engine on the tiny random Llama: bad input is refused with a clear error while other requests keep
running and finish with HF's greedy tokens; abort frees a request's blocks mid-flight."""

import copy

import pytest

from engine_driver import BLOCK_SIZE, BYTES_PER_BLOCK, VOCAB, assert_pool_empty, drain, greedy, make_engine, make_prompt
from workers.engine.engine import Engine, EngineConfig, StepOutput
from workers.values.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# max_model_len 32 and 6 blocks (24 tokens): the two good requests (4 + 6 tokens each) fill the pool.
BAD_REQUESTS = [
    ([], 4, "prompt is empty"),
    (list(range(32)), 1, "prompt has 32 tokens but the context holds 32"),
    (list(range(40)), 1, "prompt has 40 tokens but the context holds 32"),
    (list(range(20)), 13, r"prompt of 20 tokens \+ max_tokens 13 exceeds the context of 32 tokens; lower max_tokens to at most 12"),
    (list(range(10)), 20, rf"needs 8 KV blocks .*kv_cache_bytes={6 * BYTES_PER_BLOCK} holds only 6 blocks"),
    ([1, VOCAB], 4, r"prompt token ids must lie in \[0, 256\)"),
    ([-1, 5], 4, r"prompt token ids must lie in \[0, 256\)"),
]


@pytest.mark.parametrize(
    "prompt,max_tokens,match",
    BAD_REQUESTS,
    ids=["empty", "prompt-at-context", "prompt-over-context", "output-over-context", "never-fits-kv", "out-of-vocab", "negative-token"],
)
def test_bad_request_is_refused_while_others_keep_running(tiny_model, hf_greedy, prompt, max_tokens, match):
    engine = make_engine(tiny_model, num_blocks=6, max_num_batched_tokens=16, max_model_len=32)
    good = {f"good-{i}": (make_prompt(4, seed=60 + i), greedy(6)) for i in range(2)}
    for seq_id, (good_prompt, params) in good.items():
        engine.add_request(good_prompt, params, seq_id=seq_id)
    outputs = {out.seq_id: out for _ in range(3) for out in engine.step()}
    with pytest.raises(ValueError, match=match):
        engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), seq_id="bad")
    assert engine.num_running + engine.num_waiting == 2
    late = (make_prompt(3, seed=62), greedy(2))
    engine.add_request(*late, seq_id="bad")  # the refused request left its id free
    outputs.update((out.seq_id, out) for out in drain(engine))
    for seq_id, (good_prompt, params) in {**good, "bad": late}.items():
        assert list(outputs[seq_id].output_token_ids) == hf_greedy(good_prompt, params.max_tokens)
    assert_pool_empty(engine)


def test_duplicate_request_id_is_refused_while_the_first_keeps_running(tiny_model, hf_greedy):
    engine = make_engine(tiny_model)
    prompt = make_prompt(5, seed=70)
    engine.add_request(prompt, greedy(8), seq_id="dup")
    engine.step()
    with pytest.raises(ValueError, match="request id 'dup' is already in use"):
        engine.add_request(make_prompt(3, seed=71), greedy(2), seq_id="dup")
    outputs = [out for _ in range(8) for out in engine.step()]
    assert [out.finish_reason for out in outputs] == [None] * 6 + ["length"]
    assert list(outputs[-1].output_token_ids) == hf_greedy(prompt, 8)
    assert_pool_empty(engine)
    engine.add_request(prompt, greedy(1), seq_id="dup")  # a finished request's id is free again
    assert engine.step()[0].finish_reason == "length"


def test_abort_frees_blocks_mid_flight(tiny_model, hf_greedy):
    engine = make_engine(tiny_model, max_num_seqs=2)
    requests = {f"r{i}": (make_prompt(n, seed=80 + i), greedy(10)) for i, n in enumerate((5, 9, 7, 6))}
    for seq_id in ("r0", "r1", "r2"):
        engine.add_request(*requests[seq_id], seq_id=seq_id)
    produced: dict[str, list[int]] = {}
    finished: dict[str, StepOutput] = {}

    def record(outputs: list[StepOutput]) -> None:
        for out in outputs:
            produced.setdefault(out.seq_id, []).append(out.token_id)
            if out.is_finished:
                finished[out.seq_id] = out

    for _ in range(3):
        record(engine.step())
    assert (engine.num_running, engine.num_waiting) == (2, 1)
    held = len(engine.allocator.block_table("r1"))
    free_before = engine.allocator.num_free_blocks
    assert engine.abort("r1")
    assert not engine.allocator.has("r1")
    assert engine.allocator.num_free_blocks == free_before + held
    engine.allocator.check_invariants()
    assert not engine.abort("r1")
    assert not engine.abort("never-added")
    assert engine.abort("r2")  # still waiting: it leaves the queue
    num_r1_tokens = len(produced["r1"])
    engine.add_request(*requests["r3"], seq_id="r3")
    record(drain(engine))
    assert len(produced["r1"]) == num_r1_tokens and "r2" not in produced
    assert sorted(finished) == ["r0", "r3"]
    for seq_id in ("r0", "r3"):
        assert list(finished[seq_id].output_token_ids) == hf_greedy(requests[seq_id][0], 10)
    assert not engine.abort("r0")  # finished requests are gone
    assert_pool_empty(engine)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"kv_cache_bytes": 0}, "kv_cache_bytes must be > 0, got 0"),
        ({"block_size": 3}, "block_size must be a power of two, got 3"),
        ({"max_model_len": 1}, "max_model_len must be >= 2, got 1"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be >= 1, got 0"),
    ],
)
def test_engine_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig.of(**kwargs)


def test_engine_refuses_a_context_longer_than_the_model(tiny_model):
    with pytest.raises(ValueError, match="max_model_len 1024 exceeds the model's max_position_embeddings 512"):
        make_engine(tiny_model, max_model_len=1024)


def test_engine_refuses_a_budget_without_one_block(tiny_model):
    with pytest.raises(ValueError, match=f"kv_cache_bytes={BYTES_PER_BLOCK - 1} holds no block of {BYTES_PER_BLOCK} bytes"):
        Engine(copy.deepcopy(tiny_model), EngineConfig.of(kv_cache_bytes=BYTES_PER_BLOCK - 1, block_size=BLOCK_SIZE))


@pytest.mark.parametrize("predicted", [3.5, 0, True, "12"])
def test_a_malformed_prediction_is_refused_at_the_door(tiny_model, hf_greedy, predicted):
    engine = make_engine(tiny_model)
    prompt = make_prompt(5, seed=80)
    engine.add_request(prompt, greedy(6), seq_id="good")
    with pytest.raises(ValueError, match="predicted_output_tokens must be an integer >= 1"):
        engine.add_request(make_prompt(3, seed=81), greedy(4), predicted_output_tokens=predicted)
    outputs = drain(engine)
    assert list(outputs[-1].output_token_ids) == hf_greedy(prompt, 6)
    assert_pool_empty(engine)


def test_oracle_policy_refuses_a_request_without_its_true_length_and_keeps_serving(tiny_model, hf_greedy):
    from workers.scheduling.policies import OraclePolicy

    model = copy.deepcopy(tiny_model)
    engine = Engine(model, EngineConfig.of(kv_cache_bytes=64 * BYTES_PER_BLOCK, block_size=BLOCK_SIZE,
                                        max_num_seqs=4, max_num_batched_tokens=64), policy=OraclePolicy())
    prompt = make_prompt(5, seed=82)
    engine.add_request(prompt, SamplingParams(max_tokens=20, forced_output_tokens=6), seq_id="good")
    with pytest.raises(ValueError, match="forced_output_tokens"):
        engine.add_request(make_prompt(3, seed=83), greedy(4))
    outputs = drain(engine)
    assert list(outputs[-1].output_token_ids) == hf_greedy(prompt, 6)
    assert outputs[-1].finish_reason == "length"
    assert_pool_empty(engine)
