"""min_tokens, stop_token_ids, penalties and logit_bias through the engine (tiny random model)."""

import pytest

from engine_driver import greedy, make_engine, make_model, make_prompt
from workers.values.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def model():
    return make_model(seed=11)


def test_a_stop_token_id_ends_the_answer_with_stop(model):
    prompt = make_prompt(12, seed=1)
    free = make_engine(model).generate([prompt], greedy(12))[0]
    engine = make_engine(model)
    seq_id = engine.add_request(prompt, SamplingParams(max_tokens=12, stop_token_ids=(free[3],)))
    outputs = [out for _ in range(40) for out in engine.step() if out.seq_id == seq_id]
    last = outputs[-1]
    first_stop = free.index(free[3])
    assert list(last.output_token_ids) == free[:first_stop + 1] and last.finish_reason == "stop"


def test_min_tokens_keeps_eos_away_until_reached(model):
    prompt = make_prompt(9, seed=2)
    first = make_engine(model).generate([prompt], greedy(1))[0][0]
    engine = make_engine(model, eos_token_id=first)  # EOS is the greedy first token: the answer ends at once
    assert engine.generate([prompt], SamplingParams(max_tokens=10)) == [[first]]
    answer = make_engine(model, eos_token_id=first).generate([prompt], SamplingParams(max_tokens=10,
                                                                                      min_tokens=4))[0]
    assert len(answer) >= 5 and first not in answer[:4]


def test_penalties_and_bias_change_a_greedy_answer_as_asked(model):
    prompt = make_prompt(10, seed=3)
    plain = make_engine(model).generate([prompt], greedy(16))[0]
    banned = plain[0]
    biased = make_engine(model).generate([prompt], greedy(16, logit_bias=((banned, -100.0),)))[0]
    assert banned not in biased
    repeats = max(plain.count(t) for t in set(plain))
    penalised = make_engine(model).generate([prompt], greedy(16, frequency_penalty=2.0, presence_penalty=2.0))[0]
    assert max(penalised.count(t) for t in set(penalised)) <= repeats and penalised != plain


def test_token_ids_outside_the_vocabulary_are_refused_at_add(model):
    engine = make_engine(model)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=4, stop_token_ids=(10_000,)))
