"""SamplingParams validation and the batched Sampler on hand-made logits."""

import math

import pytest
import torch

from workers.engine.sampling import Sampler
from workers.values.sampling_params import SamplingParams

VOCAB = 50


def random_logits(num_rows: int, seed: int, vocab: int = VOCAB, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def draw(sampler: Sampler, logits_rows: list[torch.Tensor], seq_id: str, params: SamplingParams) -> list[int]:
    """Sample one row per step for a single sequence."""
    return [sampler.sample(row.unsqueeze(0), [seq_id], [params])[0] for row in logits_rows]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"max_tokens": 0}, "max_tokens must be an integer >= 1, got 0"),
        ({"max_tokens": -3}, "max_tokens must be an integer >= 1, got -3"),
        ({"max_tokens": 2.5}, "max_tokens must be an integer >= 1, got 2.5"),
        ({"max_tokens": True}, "max_tokens must be an integer >= 1, got True"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1.5"),
        ({"temperature": -0.5}, r"temperature must be in \[0, 100\], got -0.5"),
        ({"temperature": 1000.0}, r"temperature must be in \[0, 100\], got 1000.0"),
        ({"temperature": math.nan}, r"temperature must be in \[0, 100\], got nan"),
        ({"stop": "###"}, "stop must be a tuple of non-empty strings, got '###'"),
        ({"stop": ("ok", "")}, "stop must be a tuple of non-empty strings"),
        ({"stop": (3,)}, "stop must be a tuple of non-empty strings"),
    ],
)
def test_params_reject_bad_values_and_show_them(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_params_accept_the_edges():
    assert SamplingParams(max_tokens=1, temperature=0.0, top_p=1.0).is_greedy
    assert not SamplingParams(temperature=100.0, top_p=1e-9, stop=("a", "bc")).is_greedy


def test_greedy_rows_take_the_argmax():
    logits = random_logits(16, seed=0)
    params = [SamplingParams()] * 16
    assert Sampler().sample(logits, [f"s{i}" for i in range(16)], params) == torch.argmax(logits, dim=-1).tolist()


def test_mixed_batch_keeps_greedy_rows_greedy():
    logits = random_logits(6, seed=1)
    params = [SamplingParams(temperature=1.0, seed=i) if i % 2 else SamplingParams() for i in range(6)]
    tokens = Sampler().sample(logits, [f"s{i}" for i in range(6)], params)
    argmax = torch.argmax(logits, dim=-1).tolist()
    assert [tokens[i] for i in (0, 2, 4)] == [argmax[i] for i in (0, 2, 4)]


def test_seeded_samples_do_not_depend_on_the_rest_of_the_batch():
    steps = [random_logits(1, seed=100 + step, scale=1.0)[0] for step in range(30)]
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=7)
    alone = draw(Sampler(), steps, "x", params)

    crowded_sampler = Sampler()
    crowded = []
    for step, row in enumerate(steps):
        others = random_logits(3, seed=500 + step, scale=1.0)
        # x sits at a different row each step, between greedy, seeded and unseeded neighbours.
        position = step % 4
        rows = list(others)
        rows.insert(position, row)
        ids = ["g", "s", "u"]
        ids.insert(position, "x")
        neighbour_params = [SamplingParams(), SamplingParams(temperature=2.0, seed=7), SamplingParams(temperature=1.0)]
        neighbour_params.insert(position, params)
        crowded.append(crowded_sampler.sample(torch.stack(rows), ids, neighbour_params)[position])
    assert crowded == alone


def test_different_seeds_give_different_samples():
    steps = [torch.zeros(VOCAB)] * 40  # uniform: any two seeds agreeing 40 times would be a bug
    samples = {seed: draw(Sampler(), steps, "x", SamplingParams(temperature=1.0, seed=seed)) for seed in (1, 2, 3)}
    assert samples[1] != samples[2] and samples[2] != samples[3] and samples[1] != samples[3]
    assert samples[1] == draw(Sampler(), steps, "x", SamplingParams(temperature=1.0, seed=1))


def test_unseeded_requests_draw_their_own_seed():
    steps = [torch.zeros(VOCAB)] * 40
    params = SamplingParams(temperature=1.0)
    assert draw(Sampler(), steps, "x", params) != draw(Sampler(), steps, "x", params)


def test_forget_restarts_a_seeded_stream():
    steps = [torch.zeros(VOCAB)] * 20
    params = SamplingParams(temperature=1.0, seed=3)
    sampler = Sampler()
    first = draw(sampler, steps, "x", params)
    continued = draw(sampler, steps, "x", params)
    sampler.forget("x")
    assert continued != first
    assert draw(sampler, steps, "x", params) == first


def test_tiny_top_p_picks_the_argmax():
    logits = random_logits(32, seed=2, scale=0.5)  # flat enough that plain sampling would stray
    params = [SamplingParams(temperature=1.5, top_p=1e-6, seed=i) for i in range(32)]
    tokens = Sampler().sample(logits, [f"s{i}" for i in range(32)], params)
    assert tokens == torch.argmax(logits, dim=-1).tolist()


def test_top_p_keeps_the_smallest_prefix_reaching_the_mass():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    # Mass before each token: 0, 0.4, 0.7, 0.9; with top_p 0.5 only tokens 0 and 1 survive.
    samples = draw(Sampler(), [probs.log()] * 2000, "x", SamplingParams(temperature=1.0, top_p=0.5, seed=0))
    counts = [samples.count(token) for token in range(4)]
    assert counts[2] == counts[3] == 0
    assert abs(counts[0] / 2000 - 4 / 7) < 0.05


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_samples_follow_the_softmax(temperature):
    logits = torch.tensor([1.0, 0.5, 0.2, 0.0, -0.5, -1.0])  # every bin expects >= 40 draws
    expected = torch.softmax(logits / temperature, dim=-1)
    num_draws = 4000
    samples = draw(Sampler(), [logits] * num_draws, "x", SamplingParams(temperature=temperature, seed=11))
    observed = torch.bincount(torch.tensor(samples), minlength=len(logits)).double()
    expected_counts = expected.double() * num_draws
    chi_square = float(((observed - expected_counts) ** 2 / expected_counts).sum())
    # 5 degrees of freedom: P(chi2 > 20.5) = 0.001. A wrong temperature gives hundreds.
    assert chi_square < 20.5, (observed.tolist(), expected_counts.tolist())


def test_a_tiny_positive_temperature_acts_greedy():
    # logits / 1e-39 overflows float32 to inf and softmax turns it into NaN; accepting the
    # temperature and then failing in the sampler would crash the whole engine step.
    logits = torch.tensor([[5.0, 1.0, -2.0]])
    params = SamplingParams(temperature=1e-39, seed=0)
    assert params.is_greedy
    assert Sampler().sample(logits, ["x"], [params]) == [0]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"top_k": -2}, "top_k must be an integer >= -1"),
        ({"min_p": 1.5}, r"min_p must be in \[0, 1\]"),
        ({"presence_penalty": 3.0}, r"presence_penalty must be in \[-2, 2\]"),
        ({"repetition_penalty": 0.0}, r"repetition_penalty must be in \(0, 10\]"),
        ({"min_tokens": 300}, r"min_tokens must be an integer in \[0, max_tokens=256\]"),
        ({"stop_token_ids": [1]}, "stop_token_ids must be a tuple of token ids"),
        ({"logit_bias": ((1, 200.0),)}, "logit_bias must be"),
    ],
)
def test_sampling_extras_reject_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)
