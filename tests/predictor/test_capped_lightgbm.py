"""The cap-aware LightGBM predictor on synthetic censored lengths whose truth is known."""

import numpy as np
import pytest

from predictor_service.artifacts import load_predictor, save_predictor
from predictor_service.length_example import LengthExample
from predictor_service.kinds import CAPPED_LIGHTGBM
from predictor_service.training import make_predictor
from predictor_service.metrics import kendall_tau

MAX_TOKENS = 400


def _cap_chance(size: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-(size - 100.0) / 20.0))


def _expected_capped(size: np.ndarray) -> np.ndarray:
    """E[min(L, cap)]: the cap with the cap's chance, else a log-normal finished length well below it."""
    finished_mean = (5.0 + size / 2.0) * np.exp(0.3 ** 2 / 2)
    return _cap_chance(size) * MAX_TOKENS + (1.0 - _cap_chance(size)) * finished_mean


def _examples(sizes) -> list[LengthExample]:
    return [LengthExample(f"p:{i}", "word " * 3, int(size), MAX_TOKENS) for i, size in enumerate(sizes)]


def _censored_lengths(sizes: np.ndarray, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    finished = np.minimum(MAX_TOKENS - 1, np.rint((5.0 + sizes / 2.0) * np.exp(rng.normal(0.0, 0.3, len(sizes)))))
    capped = rng.random(len(sizes)) < _cap_chance(sizes)
    return np.where(capped, MAX_TOKENS, finished).astype(int).tolist()


@pytest.fixture(scope="module")
def fitted():
    sizes = np.random.default_rng(1).integers(10, 200, size=2000)
    examples, lengths = _examples(sizes), _censored_lengths(sizes, seed=2)
    capped = make_predictor(CAPPED_LIGHTGBM, max_len=512).fit(examples, lengths)
    plain = make_predictor("lightgbm", max_len=512).fit(examples, lengths)
    return capped, plain


def test_it_learns_the_chance_of_the_cap_and_points_at_the_expected_capped_length(fitted):
    capped, plain = fitted
    grid = np.arange(20, 190, 5)
    examples = _examples(grid)
    assert np.mean(np.abs(capped.cap_probability(examples) - _cap_chance(grid))) < 0.08
    truth = _expected_capped(grid)
    capped_points = np.array([p.point_tokens for p in capped.predict_examples(examples)])
    plain_points = np.array([p.point_tokens for p in plain.predict_examples(examples)])
    assert kendall_tau(capped_points, truth) > 0.85
    # Regressing log length treats a cap hit as a length: its point falls far below the expected work near the cap
    assert np.mean(np.abs(capped_points - truth)) < 0.5 * np.mean(np.abs(plain_points - truth))


def test_a_cap_aware_artifact_loads_back_with_its_cap_boosters(fitted, tmp_path):
    capped, _ = fitted
    directory = save_predictor(capped, tmp_path / "art", {}, {})
    loaded = load_predictor(tmp_path / "art")
    examples = _examples([30, 100, 180])
    assert loaded.cap_aware and [p.point_tokens for p in loaded.predict_examples(examples)] == [
        p.point_tokens for p in capped.predict_examples(examples)]
    assert (directory / "cap.lgb.txt").is_file() and (directory / "finished.lgb.txt").is_file()


def test_cap_awareness_needs_both_kinds_of_answer():
    examples = _examples([10, 20, 30, 40, 50, 60])
    with pytest.raises(ValueError, match="0 of 6 ran to the cap"):
        make_predictor(CAPPED_LIGHTGBM, max_len=512).fit(examples, [5, 6, 7, 8, 9, 10])
    with pytest.raises(ValueError, match="cap_probability needs a cap_aware"):
        make_predictor("lightgbm", max_len=512).fit(examples, [5, 6, 7, 8, 9, 400]).cap_probability(examples)


def _censored_rows(num_prompts: int, hidden_size: int, seed: int):
    """Probe rows at 0, 64 and 128 decoded tokens: 40% of answers run to their 500-token cap, flagged along one
    direction of the state; the others stop at a length carried along another."""
    from predictor_service.hidden_features import HiddenFeatures

    rng = np.random.default_rng(seed)
    flag_dir, length_dir = np.eye(hidden_size)[0], np.eye(hidden_size)[1]
    capped = rng.random(num_prompts) < 0.4
    totals = np.where(capped, 500, rng.integers(2, 300, size=num_prompts))
    rows = [(p, n) for p in range(num_prompts) for n in (0, 64, 128) if n < totals[p]]
    prompt = np.array([p for p, _ in rows])
    decoded = np.array([n for _, n in rows], dtype=np.int64)
    hidden = (rng.normal(size=(len(rows), hidden_size)) + 4.0 * capped[prompt][:, None] * flag_dir
              + np.log1p(np.where(capped, 50, totals))[prompt][:, None] * length_dir)
    return HiddenFeatures(np.array([f"set:{p}" for p in prompt]), np.full(len(rows), 20, dtype=np.int64), decoded,
                          np.full(len(rows), 500, dtype=np.int64), totals[prompt].astype(np.int64),
                          hidden.astype(np.float16), {"max_len": 520})


def test_a_cap_aware_probe_points_at_the_tokens_still_allowed_for_answers_that_will_run_to_the_cap(tmp_path):
    from predictor_service.hidden_probe import HiddenStateProbe, ProbeConfig

    train, test = _censored_rows(600, 8, seed=1), _censored_rows(200, 8, seed=2)
    probe = HiddenStateProbe(ProbeConfig(max_len=520, hidden_units=0, cap_aware=True), 8).fit(train)
    later = test.take(test.num_output_tokens == 128)
    out = probe.predict_rows(later.hidden, later.num_prompt_tokens, later.num_output_tokens, later.max_tokens)
    allowed = later.max_tokens - later.num_output_tokens
    will_cap = later.output_tokens >= later.max_tokens
    assert np.median(np.abs(out.point_remaining[will_cap] - allowed[will_cap]) / allowed[will_cap]) < 0.25
    assert np.median(out.point_remaining[~will_cap]) < 0.5 * np.median(allowed[~will_cap])
    assert kendall_tau(out.point_remaining, later.remaining_tokens) > 0.5
    loaded = HiddenStateProbe.load(probe.save(tmp_path / "probe"))
    again = loaded.predict_rows(later.hidden, later.num_prompt_tokens, later.num_output_tokens, later.max_tokens)
    assert np.array_equal(again.point_remaining, out.point_remaining)
