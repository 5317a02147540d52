"""Bias, bans and penalties on a step's logits against plain per-row reference computations (Hugging Face's
repetition penalty processor for that one), and the sampler's top-k and min-p."""

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from workers.engine.logit_adjustments import adjust_logits
from workers.engine.sampling import Sampler, _truncate
from workers.values.sampling_params import SamplingParams

VOCAB = 40
EOS = frozenset({2})


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_rows_that_ask_for_nothing_cost_nothing():
    logits = _logits(2)
    params = [SamplingParams(), SamplingParams(temperature=1.0, top_k=5)]  # top-k acts later, in the sampler
    assert adjust_logits(logits, params, [([1], [4]), ([1], [])], EOS) is logits


def test_logit_bias_adds_to_the_named_tokens_of_its_row_only():
    logits = _logits(2)
    params = [SamplingParams(logit_bias=((3, 5.0), (39, -100.0))), SamplingParams()]
    got = adjust_logits(logits, params, [([1], []), ([1], [])], EOS)
    want = logits.clone()
    want[0, 3] += 5.0
    want[0, 39] -= 100.0
    assert torch.equal(got, want) and got is not logits


def test_min_tokens_bans_eos_and_stop_tokens_until_reached():
    logits = _logits(3)
    params = [SamplingParams(min_tokens=3, stop_token_ids=(7,)), SamplingParams(min_tokens=2, stop_token_ids=(7,)),
              SamplingParams(min_tokens=3, ignore_eos=True)]
    got = adjust_logits(logits, params, [([1], [5, 6]), ([1], [5, 6]), ([1], [])], EOS)
    assert got[0, 2] == got[0, 7] == float("-inf")  # 2 of 3 tokens out: still banned
    assert torch.equal(got[1], logits[1])  # min_tokens reached
    assert got[2, 2] == logits[2, 2]  # ignore_eos: EOS ends nothing, so it stays a token like any other


def test_repetition_penalty_is_hugging_faces_over_prompt_and_output():
    logits = _logits(2, seed=1)
    histories = [([4, 9, 9], [11, 4]), ([30], [])]
    params = [SamplingParams(repetition_penalty=1.3), SamplingParams(repetition_penalty=0.8)]
    got = adjust_logits(logits, params, histories, EOS)
    for row, (prompt, output) in enumerate(histories):
        processor = RepetitionPenaltyLogitsProcessor(params[row].repetition_penalty)
        want = processor(torch.tensor([prompt + output]), logits[row:row + 1].clone())[0]
        torch.testing.assert_close(got[row], want)


def test_presence_and_frequency_penalties_count_the_output_only():
    logits = _logits(2, seed=2)
    histories = [([5, 5, 5], [8, 8, 8, 1]), ([5], [5])]
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), SamplingParams(frequency_penalty=-1.0)]
    got = adjust_logits(logits, params, histories, EOS)
    want = logits.clone()
    for row, (_, output) in enumerate(histories):  # OpenAI's formula, token by token
        for token in set(output):
            want[row, token] -= params[row].frequency_penalty * output.count(token) + params[row].presence_penalty
    torch.testing.assert_close(got, want)


def test_bias_then_penalties_in_one_step_and_bf16_logits_come_back_float32():
    logits = _logits(1, seed=3).to(torch.bfloat16)
    params = [SamplingParams(logit_bias=((6, 1.0),), repetition_penalty=2.0, presence_penalty=1.0)]
    got = adjust_logits(logits, params, [([6], [6])], EOS)
    biased = logits[0, 6].float() + 1.0
    penalised = biased / 2.0 if biased > 0 else biased * 2.0
    assert got.dtype == torch.float32 and got[0, 6] == penalised - 1.0


def test_a_biased_greedy_row_picks_the_biased_token():
    logits = _logits(2, seed=4)
    low = int(logits[0].argmin())
    params = [SamplingParams(logit_bias=((low, 100.0),)), SamplingParams()]
    tokens = Sampler(EOS).sample(logits, ["a", "b"], params, [([1], []), ([1], [])])
    assert tokens == [low, int(logits[1].argmax())]


def _reference_truncate(probs: torch.Tensor, top_k: int, min_p: float) -> torch.Tensor:
    kept = probs.clone()
    if top_k > 0:
        kept[top_k:] = 0
    kept[kept < min_p * probs[0]] = 0
    return kept / kept.sum()


@pytest.mark.parametrize("top_k, min_p", [(3, 0.0), (0, 0.2), (5, 0.05), (-1, 0.0)])
def test_top_k_and_min_p_keep_what_a_plain_computation_keeps(top_k, min_p):
    probs = torch.softmax(_logits(2, seed=5), dim=-1)
    sorted_probs = torch.sort(probs, dim=-1, descending=True).values
    params = [SamplingParams(temperature=1.0, top_k=top_k, min_p=min_p)] * 2
    got = _truncate(sorted_probs, params)
    for row in range(2):
        torch.testing.assert_close(got[row], _reference_truncate(sorted_probs[row], top_k, min_p))


def test_sampled_tokens_stay_inside_top_k():
    logits = _logits(1, seed=6)
    allowed = set(torch.topk(logits[0], 3).indices.tolist())
    sampler = Sampler(EOS)
    params = SamplingParams(temperature=2.0, top_k=3, seed=1)
    draws = {sampler.sample(logits, ["s"], [params], [([1], [])])[0] for _ in range(200)}
    assert draws <= allowed and len(draws) == 3
