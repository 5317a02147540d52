"""The loop flag: an answer whose last tokens occurred earlier in it (pure), and the engine setting it."""

import pytest

from workers.scheduling.length_distribution import LengthDistribution
from workers.scheduling.repetition import LOOP_CHECK_EVERY, repeats_itself


def test_the_last_ngram_occurring_earlier_is_a_loop_and_nothing_else_is():
    phrase = list(range(100, 120))
    assert repeats_itself(list(range(40)) + phrase + list(range(50, 60)) + phrase[:16], ngram_tokens=16)
    assert not repeats_itself(list(range(300)), ngram_tokens=16)  # no token sequence comes back
    assert not repeats_itself(phrase[:16], ngram_tokens=16)  # only the tail itself
    assert repeats_itself([7] * 17, ngram_tokens=16)  # one token over and over: overlapping occurrences
    assert not repeats_itself([7] * 16, ngram_tokens=16)


def test_token_ids_past_one_byte_are_compared_whole_not_by_bytes():
    # 256 and 1 share bytes with 1 and 0 once packed; only whole tokens may match
    assert not repeats_itself([1, 0, 1, 0, 256, 1], ngram_tokens=2)
    assert repeats_itself([1, 256, 3, 1, 256], ngram_tokens=2)
    with pytest.raises(ValueError, match="ngram_tokens must be >= 1"):
        repeats_itself([1, 2], ngram_tokens=0)


def test_a_looping_answer_is_expected_to_run_to_its_limit():
    lengths = LengthDistribution()
    assert lengths.remaining_of(40, 100, 512, is_looping=True) == 412.0
    assert lengths.remaining_of(40, 100, 512) < 412.0


@pytest.mark.parametrize("init_std, loops", [(0.05, True), (0.2, False)])
def test_the_engine_flags_an_answer_that_repeats_itself_and_not_a_forced_one(init_std, loops):
    from engine_driver import BLOCK_SIZE, BYTES_PER_BLOCK, VOCAB, make_prompt
    from workers.engine.engine import Engine, EngineConfig
    from workers.engine.models import make_tiny_model
    from workers.values.sampling_params import SamplingParams

    # A tiny random Llama with small weights falls into repeating one token under greedy; at std 0.2 it does not.
    model = make_tiny_model(0, vocab_size=VOCAB, init_std=init_std)
    engine = Engine(model, EngineConfig.of(kv_cache_bytes=64 * BYTES_PER_BLOCK, block_size=BLOCK_SIZE, max_num_seqs=4))
    prompt = make_prompt(8, seed=3)
    engine.add_request(prompt, SamplingParams(max_tokens=120, ignore_eos=True), seq_id="free")  # not forced
    engine.add_request(prompt, SamplingParams(max_tokens=120, ignore_eos=True, forced_output_tokens=120),
                       seq_id="forced")
    flags = {}
    while engine.has_unfinished():
        engine.step()
        for seq_id in ("free", "forced"):
            seq = engine.sequence(seq_id)
            if seq is not None:
                flags[seq_id] = (seq.is_looping, list(seq.output_token_ids))
    looping, tokens = flags["free"]
    # the tiny random model's greedy answer: flagged exactly when its tokens so far repeat themselves at a check
    checked = len(tokens) - len(tokens) % LOOP_CHECK_EVERY
    assert looping == any(repeats_itself(tokens[:n]) for n in range(LOOP_CHECK_EVERY, checked + 1, LOOP_CHECK_EVERY))
    assert looping is loops
    assert flags["forced"][0] is False  # a forced length is known: never flagged, whatever its tokens


def test_a_resumed_answer_that_already_repeats_itself_is_flagged_on_arrival(tiny_model):
    import copy

    from engine_driver import BLOCK_SIZE, BYTES_PER_BLOCK, make_prompt
    from workers.engine.engine import Engine, EngineConfig
    from workers.values.sampling_params import SamplingParams

    engine = Engine(copy.deepcopy(tiny_model), EngineConfig.of(kv_cache_bytes=64 * BYTES_PER_BLOCK,
                                                            block_size=BLOCK_SIZE))
    loop = list(range(20, 40))
    engine.add_request(make_prompt(8, seed=1), SamplingParams(max_tokens=100), seq_id="moved",
                       resumed_output_token_ids=loop + loop)
    engine.add_request(make_prompt(8, seed=1), SamplingParams(max_tokens=100), seq_id="fresh",
                       resumed_output_token_ids=list(range(40)))
    assert engine.sequence("moved").is_looping and not engine.sequence("fresh").is_looping
