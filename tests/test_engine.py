"""Engine on the tiny random Llama: greedy tokens equal Hugging Face `generate`, stopping, sampling, bad input, abort.

Budgets are given in blocks: the tiny model's block of 4 tokens takes
2 (K and V) * 2 layers * 4 tokens * 2 kv heads * 16 head_dim * 4 bytes = 1024 bytes.
"""

import copy
import random
from dataclasses import replace

import pytest
import torch

from workers.engine import Engine, EngineConfig, StepOutput
from workers.models import make_tiny_model
from workers.sampling_params import SamplingParams

BLOCK_SIZE = 4
BYTES_PER_BLOCK = 2 * 2 * BLOCK_SIZE * 2 * 16 * 4
VOCAB = 256


def make_model(seed: int = 0, vocab_size: int = VOCAB) -> torch.nn.Module:
    """The tiny random Llama with its weights redrawn at std 0.2.

    At its default init (std 0.02) the tiny model echoes the last prompt token
    whatever comes before it, so its greedy tokens would match HF even if
    attention read the wrong KV blocks; at std 0.2 every token depends on the context.
    """
    return make_tiny_model(seed, vocab_size=vocab_size, init_std=0.2)


def make_engine(
    model: torch.nn.Module,
    num_blocks: int = 64,
    max_num_seqs: int = 4,
    max_num_batched_tokens: int = 64,
    max_model_len: int | None = None,
    eos_token_id: int | None = None,
    tokenizer=None,
) -> Engine:
    """An engine over a private copy of `model` (the engine rewires the attention of the model it gets)."""
    model = copy.deepcopy(model)
    if eos_token_id is not None:
        model.generation_config.eos_token_id = eos_token_id
    config = EngineConfig(
        kv_cache_bytes=num_blocks * BYTES_PER_BLOCK,
        block_size=BLOCK_SIZE,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
    )
    return Engine(model, config, tokenizer=tokenizer)


def make_prompt(num_tokens: int, seed: int, vocab_size: int = VOCAB) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab_size) for _ in range(num_tokens)]


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kwargs)


def run_engine(
    engine: Engine,
    requests: dict[str, tuple[list[int], SamplingParams]],
    arrivals: dict[int, list[str]],
    max_steps: int = 2000,
) -> dict[str, StepOutput]:
    """Add each request at its step, step until done; return every request's last StepOutput.

    Checks that a request streams exactly the tokens its last output lists, and
    that it yields nothing after it finished.
    """
    streamed: dict[str, list[int]] = {}
    final: dict[str, StepOutput] = {}
    step = 0
    while step <= max(arrivals) or engine.has_unfinished():
        assert step < max_steps, "the engine stopped making progress"
        for seq_id in arrivals.get(step, []):
            prompt, params = requests[seq_id]
            engine.add_request(prompt, params, seq_id=seq_id)
        for out in engine.step():
            assert out.seq_id not in final, f"{out.seq_id} produced a token after finishing"
            streamed.setdefault(out.seq_id, []).append(out.token_id)
            if out.is_finished:
                final[out.seq_id] = out
        step += 1
    for seq_id, out in final.items():
        assert list(out.output_token_ids) == streamed[seq_id]
    return final


def drain(engine: Engine, max_steps: int = 500) -> list[StepOutput]:
    """Step until every request finished; fail instead of spinning if the engine stalls."""
    outputs = []
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return outputs
        outputs.extend(engine.step())
    raise AssertionError(f"still unfinished after {max_steps} steps")


def assert_pool_empty(engine: Engine) -> None:
    assert not engine.has_unfinished()
    assert engine.allocator.num_free_blocks == engine.allocator.num_blocks
    engine.allocator.check_invariants()


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """The tiny model's matmuls are too small to split; on a busy machine extra threads only spin."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


@pytest.fixture(scope="module")
def tiny_model() -> torch.nn.Module:
    """Engines get deep copies of it; it never runs itself."""
    return make_model(seed=0)


@pytest.fixture(scope="module")
def hf_greedy(tiny_model):
    """HF greedy `generate`, one prompt at a time, on its own copy with sdpa attention."""
    from transformers import GenerationConfig

    model = copy.deepcopy(tiny_model)
    model.set_attn_implementation("sdpa")
    memo: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def run(prompt: list[int], max_new_tokens: int) -> list[int]:
        key = (tuple(prompt), max_new_tokens)
        if key not in memo:
            generation_config = GenerationConfig(
                max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=2
            )
            with torch.no_grad():
                out = model.generate(torch.tensor([prompt]), generation_config=generation_config)
            tokens = out[0, len(prompt):].tolist()
            assert len(tokens) == max_new_tokens
            memo[key] = tokens
        return memo[key]

    return run


# (prompt tokens, output tokens) per request: lengths around block boundaries, long prompts that must be chunked.
SHAPES = [(5, 7), (17, 3), (3, 12), (26, 5), (9, 9), (12, 14)]
# Requests join while others are mid-prefill or mid-decode, and leave at different steps.
ARRIVALS = {0: ["r0", "r1"], 2: ["r2"], 3: ["r3", "r4"], 6: ["r5"]}


def shaped_requests() -> dict[str, tuple[list[int], SamplingParams]]:
    return {
        f"r{i}": (make_prompt(num_prompt, seed=i), greedy(num_output))
        for i, (num_prompt, num_output) in enumerate(SHAPES)
    }


@pytest.mark.parametrize(
    "num_blocks,max_num_batched_tokens",
    [(64, 64), (64, 8), (10, 16)],
    ids=["roomy", "chunked", "tight-preempts"],
)
def test_greedy_matches_hf_generate(tiny_model, hf_greedy, num_blocks, max_num_batched_tokens):
    engine = make_engine(tiny_model, num_blocks=num_blocks, max_num_batched_tokens=max_num_batched_tokens)
    requests = shaped_requests()
    outputs = run_engine(engine, requests, ARRIVALS)
    assert sorted(outputs) == sorted(requests)
    for seq_id, (prompt, params) in requests.items():
        assert list(outputs[seq_id].output_token_ids) == hf_greedy(prompt, params.max_tokens), seq_id
        assert outputs[seq_id].finish_reason == "length"
    if num_blocks == 10:
        assert engine.scheduler.num_preemptions > 0
    else:
        assert engine.scheduler.num_preemptions == 0
    assert_pool_empty(engine)


def test_requests_at_the_limits_are_served(tiny_model, hf_greedy):
    # 8 blocks hold 32 tokens = max_model_len: r0 and r1 each need the whole pool.
    engine = make_engine(tiny_model, num_blocks=8, max_num_batched_tokens=16, max_model_len=32)
    requests = {
        "r0": (make_prompt(20, seed=10), greedy(12)),
        "r1": (make_prompt(31, seed=11), greedy(1)),
        "r2": (make_prompt(3, seed=12), greedy(6)),
    }
    outputs = run_engine(engine, requests, {0: ["r2", "r0"], 1: ["r1"]})
    for seq_id, (prompt, params) in requests.items():
        assert list(outputs[seq_id].output_token_ids) == hf_greedy(prompt, params.max_tokens), seq_id
    assert_pool_empty(engine)


def test_generate_returns_outputs_in_prompt_order(tiny_model, hf_greedy):
    prompts = [make_prompt(n, seed=20 + n) for n in (7, 1, 11)]
    outputs = make_engine(tiny_model).generate(prompts, [greedy(4), greedy(9), greedy(1)])
    assert outputs == [hf_greedy(prompts[0], 4), hf_greedy(prompts[1], 9), hf_greedy(prompts[2], 1)]


EOS_PROMPT = make_prompt(6, seed=30)


def test_eos_stops_with_reason_stop(tiny_model, hf_greedy):
    reference = hf_greedy(EOS_PROMPT, 10)
    eos = reference[2]
    stop_index = reference.index(eos)
    assert stop_index == 2, "pick a prompt whose first three greedy tokens differ"
    engine = make_engine(tiny_model, eos_token_id=eos)
    requests = {
        "stops": (EOS_PROMPT, SamplingParams(max_tokens=10)),
        "short": (EOS_PROMPT, SamplingParams(max_tokens=2)),
        "ignores": (EOS_PROMPT, SamplingParams(max_tokens=10, ignore_eos=True)),
    }
    outputs = run_engine(engine, requests, {0: list(requests)})
    assert outputs["stops"].finish_reason == "stop"
    assert list(outputs["stops"].output_token_ids) == reference[:3]
    assert outputs["short"].finish_reason == "length"
    assert list(outputs["short"].output_token_ids) == reference[:2]
    assert outputs["ignores"].finish_reason == "length"
    assert list(outputs["ignores"].output_token_ids) == reference
    assert_pool_empty(engine)


def test_ignore_eos_gives_exactly_max_tokens(tiny_model, hf_greedy):
    reference = hf_greedy(EOS_PROMPT, 10)
    engine = make_engine(tiny_model, eos_token_id=reference[0])  # EOS is the very first token
    outputs = run_engine(
        engine,
        {"eos": (EOS_PROMPT, SamplingParams(max_tokens=10)), "ignore": (EOS_PROMPT, greedy(10))},
        {0: ["eos", "ignore"]},
    )
    assert list(outputs["eos"].output_token_ids) == reference[:1]
    assert outputs["eos"].finish_reason == "stop"
    assert len(outputs["ignore"].output_token_ids) == 10
    assert outputs["ignore"].finish_reason == "length"


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny_model):
    prompt = make_prompt(9, seed=40)
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    alone = make_engine(tiny_model).generate([prompt], params)[0]
    assert make_engine(tiny_model).generate([prompt], params)[0] == alone

    # The same request joins a chunked, crowded batch mid-flight, neighbours sampling with the same seed,
    # in a pool so small that sequences are preempted and recomputed.
    crowded = make_engine(tiny_model, num_blocks=10, max_num_batched_tokens=8)
    requests = {
        "greedy": (make_prompt(13, seed=41), greedy(15)),
        "same-seed": (make_prompt(5, seed=42), replace(params, max_tokens=15)),
        "unseeded": (make_prompt(7, seed=43), replace(params, seed=None, max_tokens=15)),
        "ours": (prompt, params),
    }
    outputs = run_engine(crowded, requests, {0: ["greedy", "same-seed"], 2: ["unseeded"], 3: ["ours"]})
    assert list(outputs["ours"].output_token_ids) == alone
    assert crowded.scheduler.num_preemptions > 0
    assert_pool_empty(crowded)

    other_seed = make_engine(tiny_model).generate([prompt], replace(params, seed=4321))[0]
    assert other_seed != alone


def test_stop_strings_need_a_tokenizer(tiny_model):
    engine = make_engine(tiny_model)
    with pytest.raises(ValueError, match="stop strings need an engine built with a tokenizer"):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=4, stop=("x",)))
    assert not engine.has_unfinished()


@pytest.mark.slow
def test_stop_string_ends_generation(smollm2_tokenizer):
    vocab_size = 49152
    model = make_model(seed=0, vocab_size=vocab_size)
    prompt = make_prompt(8, seed=50, vocab_size=vocab_size)
    reference = make_engine(model).generate([prompt], SamplingParams(max_tokens=16))[0]
    decode = lambda ids: smollm2_tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    # The first token from the third on whose text is new to the output: stopping on it must end right there.
    stop_index, stop = next(
        (index, decode([token]).strip())
        for index, token in enumerate(reference)
        if index >= 2
        and decode([token]).strip()
        and "\ufffd" not in decode([token])
        and decode([token]).strip() not in decode(reference[:index])
    )
    # A stop string across the boundary of the next two tokens ends on the second of them.
    across = decode([reference[stop_index]])[-2:] + decode([reference[stop_index + 1]])[:2]
    assert across not in decode(reference[: stop_index + 1]) and across in decode(reference[: stop_index + 2])
    engine = make_engine(model, tokenizer=smollm2_tokenizer)
    requests = {
        "stop": (prompt, SamplingParams(max_tokens=16, stop=("never appears here", stop))),
        "across": (prompt, SamplingParams(max_tokens=16, stop=(across,))),
        "plain": (prompt, SamplingParams(max_tokens=16)),
    }
    outputs = run_engine(engine, requests, {0: ["stop", "plain"], 1: ["across"]})
    assert outputs["stop"].finish_reason == "stop"
    assert list(outputs["stop"].output_token_ids) == reference[: stop_index + 1]
    assert stop in decode(list(outputs["stop"].output_token_ids))
    assert outputs["across"].finish_reason == "stop"
    assert list(outputs["across"].output_token_ids) == reference[: stop_index + 2]
    assert list(outputs["plain"].output_token_ids) == reference
    assert_pool_empty(engine)


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
        EngineConfig(**kwargs)


def test_engine_refuses_a_context_longer_than_the_model(tiny_model):
    with pytest.raises(ValueError, match="max_model_len 1024 exceeds the model's max_position_embeddings 512"):
        make_engine(tiny_model, max_model_len=1024)


def test_engine_refuses_a_budget_without_one_block(tiny_model):
    with pytest.raises(ValueError, match=f"kv_cache_bytes={BYTES_PER_BLOCK - 1} holds no block of {BYTES_PER_BLOCK} bytes"):
        Engine(copy.deepcopy(tiny_model), EngineConfig(kv_cache_bytes=BYTES_PER_BLOCK - 1, block_size=BLOCK_SIZE))


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
    from workers.policies import OraclePolicy

    model = copy.deepcopy(tiny_model)
    engine = Engine(model, EngineConfig(kv_cache_bytes=64 * BYTES_PER_BLOCK, block_size=BLOCK_SIZE,
                                        max_num_seqs=4, max_num_batched_tokens=64), policy=OraclePolicy())
    prompt = make_prompt(5, seed=82)
    engine.add_request(prompt, SamplingParams(max_tokens=20, forced_output_tokens=6), seq_id="good")
    with pytest.raises(ValueError, match="forced_output_tokens"):
        engine.add_request(make_prompt(3, seed=83), greedy(4))
    outputs = drain(engine)
    assert list(outputs[-1].output_token_ids) == hf_greedy(prompt, 6)
    assert outputs[-1].finish_reason == "length"
    assert_pool_empty(engine)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
@pytest.mark.parametrize("policy_name", ["s3", "s3_peak"])
def test_mispredicted_sequences_preempted_by_swap_or_recompute_keep_exact_greedy_tokens(
    tiny_model, hf_greedy, mode, policy_name
):
    from workers.policies import make_policy
    from workers.scheduling_policy import PreemptionCostModel

    cost = (PreemptionCostModel(prefill_s_per_token=1.0, swap_bytes_per_s=1e18, swap_overhead_s=0.0)
            if mode == "swap" else PreemptionCostModel(prefill_s_per_token=0.0, swap_bytes_per_s=1.0))
    engine = Engine(
        copy.deepcopy(tiny_model),
        EngineConfig(kv_cache_bytes=14 * BYTES_PER_BLOCK, block_size=BLOCK_SIZE, max_num_seqs=6,
                     max_num_batched_tokens=16),
        policy=make_policy(policy_name, bucket_tokens=4, cost_model=cost),
    )
    prompts = {f"r{i}": make_prompt(3 + 2 * i, seed=90 + i) for i in range(6)}
    lengths = {f"r{i}": 10 + 3 * i for i in range(6)}
    for seq_id, prompt in prompts.items():
        # Every prediction is 2 tokens: all of them outrun their reservation.
        engine.add_request(prompt, SamplingParams(max_tokens=40, forced_output_tokens=lengths[seq_id]),
                           seq_id=seq_id, predicted_output_tokens=2)
    finished = {out.seq_id: out for out in drain(engine) if out.is_finished}
    stats = engine.scheduler.stats
    assert stats.num_preemptions > 0 and stats.mispredictions
    if mode == "swap":
        assert engine.swapped_bytes > 0 and stats.num_recomputed_tokens == 0
    else:
        assert engine.swapped_bytes == 0 and stats.num_recomputed_tokens > 0
    for seq_id, prompt in prompts.items():
        assert list(finished[seq_id].output_token_ids) == hf_greedy(prompt, lengths[seq_id]), seq_id
    assert_pool_empty(engine)
