"""Engine on the tiny random Llama: greedy tokens equal Hugging Face `generate`, stopping, sampling, preemption.

Bad input and abort are in `test_engine_bad_input.py`; the shared helpers in `engine_driver.py`.
"""

import copy
from dataclasses import replace

import pytest

from engine_driver import (BLOCK_SIZE, BYTES_PER_BLOCK, assert_pool_empty, drain, greedy, make_engine, make_model,
                           make_prompt, run_engine)
from workers.engine.engine import Engine, EngineConfig, hits_stop_string
from workers.values.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")


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


def test_a_stop_string_of_many_tokens_per_character_is_found(smollm2_tokenizer):
    # "👍👍👍" is 3 characters, 12 UTF-8 bytes and 9 SmolLM2 tokens: a window of characters + 4 tokens missed it.
    stop = "👍👍👍"
    ids = smollm2_tokenizer.encode("Well done " + stop, add_special_tokens=False)
    assert len(smollm2_tokenizer.encode(stop, add_special_tokens=False)) > len(stop) + 4
    assert hits_stop_string(smollm2_tokenizer, ids, (stop,))
    assert hits_stop_string(smollm2_tokenizer, ids, ("never", stop))
    assert not hits_stop_string(smollm2_tokenizer, ids[:-1], (stop,))  # one token short: not yet
    assert not hits_stop_string(smollm2_tokenizer, ids, ("👍👍👍👍",))


@pytest.mark.parametrize("mode", ["swap", "recompute"])
@pytest.mark.parametrize("policy_name", ["s3", "s3_peak"])
def test_mispredicted_sequences_preempted_by_swap_or_recompute_keep_exact_greedy_tokens(
    tiny_model, hf_greedy, mode, policy_name
):
    from workers.scheduling.policies import make_policy

    engine = Engine(
        copy.deepcopy(tiny_model),
        EngineConfig.of(kv_cache_bytes=14 * BYTES_PER_BLOCK, block_size=BLOCK_SIZE, max_num_seqs=6,
                     max_num_batched_tokens=16, preemption_mode=mode),
        policy=make_policy(policy_name, bucket_tokens=4),
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


@pytest.mark.parametrize("policy_name", ["paged_greedy", "s3_peak"])
def test_swapped_kv_stays_within_swap_space_and_the_rest_recomputes_with_exact_greedy_tokens(
    tiny_model, hf_greedy, policy_name
):
    from workers.scheduling.policies import make_policy

    swap_space_blocks = 3
    engine = Engine(
        copy.deepcopy(tiny_model),
        EngineConfig.of(kv_cache_bytes=14 * BYTES_PER_BLOCK, block_size=BLOCK_SIZE, max_num_seqs=6,
                     max_num_batched_tokens=16, preemption_mode="swap",
                     swap_space_bytes=swap_space_blocks * BYTES_PER_BLOCK),
        policy=make_policy(policy_name, bucket_tokens=4) if policy_name == "s3_peak" else make_policy(policy_name),
    )
    prompts = {f"r{i}": make_prompt(3 + 2 * i, seed=90 + i) for i in range(6)}
    lengths = {f"r{i}": 10 + 3 * i for i in range(6)}
    for seq_id, prompt in prompts.items():
        engine.add_request(prompt, SamplingParams(max_tokens=40, forced_output_tokens=lengths[seq_id]),
                           seq_id=seq_id, predicted_output_tokens=2)
    finished = {out.seq_id: out for out in drain(engine) if out.is_finished}
    stats = engine.scheduler.stats
    assert stats.num_swaps > 0 and stats.num_swaps_over_budget > 0 and stats.num_recomputed_tokens > 0
    assert 0 < engine.scheduler.swap_space.peak_blocks <= swap_space_blocks
    for seq_id, prompt in prompts.items():
        assert list(finished[seq_id].output_token_ids) == hf_greedy(prompt, lengths[seq_id]), seq_id
    assert_pool_empty(engine)


def test_a_swap_out_that_fails_is_recomputed_instead_and_answers_are_unchanged(tiny_model, hf_greedy):
    from workers.scheduling.policies import make_policy

    engine = Engine(copy.deepcopy(tiny_model),
                    EngineConfig.of(kv_cache_bytes=14 * BYTES_PER_BLOCK, block_size=BLOCK_SIZE, max_num_seqs=6,
                                 max_num_batched_tokens=16, preemption_mode="swap"),
                    policy=make_policy("s3", bucket_tokens=4))
    copy_to_host, failed = engine.runner.swap_out, []

    def swap_out_failing_once(seq_id, block_ids):
        if not failed:
            failed.append(seq_id)
            raise RuntimeError("pinned host memory exhausted")
        return copy_to_host(seq_id, block_ids)

    engine.runner.swap_out = swap_out_failing_once
    prompts = {f"r{i}": make_prompt(3 + 2 * i, seed=90 + i) for i in range(6)}
    lengths = {f"r{i}": 10 + 3 * i for i in range(6)}
    for seq_id, prompt in prompts.items():  # predicted 2 tokens each: all outrun their reservation
        engine.add_request(prompt, SamplingParams(max_tokens=40, forced_output_tokens=lengths[seq_id]),
                           seq_id=seq_id, predicted_output_tokens=2)
    finished = {out.seq_id: out for out in drain(engine) if out.is_finished}
    stats = engine.scheduler.stats
    assert failed and stats.num_recomputed_tokens > 0  # the one that failed was recomputed
    assert engine.swapped_bytes > 0 and stats.num_swaps > 0  # the others still swapped
    for seq_id, prompt in prompts.items():
        assert list(finished[seq_id].output_token_ids) == hf_greedy(prompt, lengths[seq_id]), seq_id
    assert_pool_empty(engine)


def _large_request_wait_steps(tiny_model, max_overtaken_steps: int, max_steps: int = 600) -> tuple[int | None, bool]:
    """An engine (tiny model, s3_peak, 30 blocks of 4 tokens) running a 60-token answer, a 100-token one waiting,
    and a 60-token one queued behind it whenever fewer than two wait: (the step the large one starts, if it does;
    whether it then finished while the short ones kept arriving). The bound in seconds, and the aging of the order
    by it, are out of reach (`max_queue_wait_s`): the steps are what is tested."""
    from workers.scheduling.policies import make_policy

    engine = Engine(copy.deepcopy(tiny_model),
                    EngineConfig.of(kv_cache_bytes=30 * BYTES_PER_BLOCK, block_size=BLOCK_SIZE, max_num_seqs=16,
                                 max_num_batched_tokens=64, max_overtaken_steps=max_overtaken_steps,
                                 max_queue_wait_s=1e9),
                    policy=make_policy("s3_peak", bucket_tokens=16, overcommit_step=0.0))

    def add(seq_id: str, num_output_tokens: int, seed: int) -> None:
        engine.add_request(make_prompt(10, seed=seed), SamplingParams(max_tokens=110,
                                                                      forced_output_tokens=num_output_tokens),
                           seq_id=seq_id, predicted_output_tokens=num_output_tokens)

    add("first", 60, seed=1)
    engine.step()
    add("large", 100, seed=2)
    admitted_at, finished = None, False
    for index in range(max_steps):
        if engine.num_waiting < 2:
            add(f"next{index}", 60, seed=10 + index)
        for out in engine.step():
            finished |= out.seq_id == "large" and out.is_finished
        large = engine.sequence("large")
        if admitted_at is None and (large is None or large.status.value != "waiting"):
            admitted_at = index
        if finished:
            break
    return admitted_at, finished


def test_a_large_request_starts_within_the_starvation_bound_while_shorter_ones_keep_arriving(tiny_model):
    # Without the bound the 60-token requests keep passing it (each fits beside the one running; it never does).
    assert _large_request_wait_steps(tiny_model, max_overtaken_steps=10**9, max_steps=400) == (None, False)
    admitted_at, finished = _large_request_wait_steps(tiny_model, max_overtaken_steps=100)
    # First passed within 60 steps; 100 steps later nobody passes it, and those running end within 60 more.
    assert admitted_at is not None and 100 <= admitted_at <= 60 + 100 + 60
    assert finished
