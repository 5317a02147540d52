"""Per-setting statistics of labels and the per-temperature scores of bench predictor, on synthetic labels."""

import json
from pathlib import Path

import numpy as np
import pytest

from benchmarks import predictor_bench
from predictor_service.label_stats import explained_by_prompt, setting_stats
from predictor_service.training import LabelRow, read_labels
from s3serve_cli.main import main

MAX_TOKENS = 100


def _row(prompt_id: str, output_tokens: int, temperature: float = 1.0, top_p: float = 1.0) -> LabelRow:
    return LabelRow(prompt_id, 10, output_tokens, MAX_TOKENS, temperature, top_p)


def test_setting_stats_count_answers_at_the_limit_and_the_spread_between_samples():
    rows = [_row("a", 100, 0.0), _row("b", 20, 0.0),  # greedy: one of two at the limit
            _row("a", 100), _row("a", 40), _row("a", 60),  # sampled: a sometimes loops
            _row("b", 20), _row("b", 25), _row("b", 30),
            _row("c", 7, 0.7, 0.9)]
    greedy, sampled_c, sampled = setting_stats(rows)
    assert (greedy.temperature, greedy.num_prompts, greedy.num_answers) == (0.0, 2, 2)
    assert greedy.at_limit_share == pytest.approx(0.5)
    assert greedy.prompts_sometimes_at_limit is None and greedy.explained_by_prompt is None
    assert (sampled_c.temperature, sampled_c.top_p, sampled_c.num_answers) == (0.7, 0.9, 1)
    assert (sampled.num_prompts, sampled.num_answers) == (2, 6)
    assert sampled.at_limit_share == pytest.approx(1 / 6)
    assert sampled.prompts_sometimes_at_limit == pytest.approx(0.5)
    assert sampled.median_prompt_range_tokens == pytest.approx((60 + 10) / 2)
    assert 0.0 < sampled.explained_by_prompt < 1.0


def test_explained_by_prompt_is_one_without_draw_noise_and_near_zero_without_prompt_signal():
    assert explained_by_prompt([[1.0, 1.0], [5.0, 5.0], [9.0, 9.0]]) == pytest.approx(1.0)
    assert explained_by_prompt([[1.0, 9.0], [9.0, 1.0], [1.0, 9.0]]) == pytest.approx(0.0)
    assert explained_by_prompt([[1.0, 2.0]]) is None  # one prompt: nothing to compare
    with pytest.raises(ValueError, match="no label rows"):
        setting_stats([])


def _write_labels(path: Path, rows: list[LabelRow]) -> None:
    path.write_text("".join(json.dumps({
        "prompt_id": r.prompt_id, "sample": i, "prompt_tokens": r.num_prompt_tokens, "output_tokens": r.num_output_tokens,
        "finish_reason": "length" if r.num_output_tokens >= r.max_tokens else "stop",
        "sampling": {"max_tokens": r.max_tokens, "temperature": r.temperature, "top_p": r.top_p}}) + "\n"
        for i, r in enumerate(rows)))


def test_label_stats_command_prints_and_writes_each_setting(tmp_path: Path, capsys):
    labels = tmp_path / "labels.jsonl"
    rows = [_row("a", 100, 0.0), _row("a", 100), _row("a", 50), _row("b", 10), _row("b", 12)]
    _write_labels(labels, rows)
    assert read_labels([labels]) == rows  # top_p is read back
    assert main(["label-stats", str(labels), "--json", str(tmp_path / "stats.json")]) == 0
    assert "explained_by_prompt" in capsys.readouterr().out
    settings = json.loads((tmp_path / "stats.json").read_text())["settings"]
    assert [(s["temperature"], s["num_answers"], s["at_limit_share"]) for s in settings] == [
        (0.0, 1, 1.0), (1.0, 4, 0.25)]


def test_bench_predictor_scores_sampled_labels_per_temperature_against_each_prompts_samples(
        shared_data: Path, tmp_path: Path):
    prompts = shared_data / "prompts" / "pool.jsonl"
    ids = list(predictor_bench.load_prompt_texts_by_id([prompts]))[:300]
    rows = []
    for rank, prompt_id in enumerate(ids):
        prompt_tokens = 10 + rank % 97  # the length follows the prompt length; each draw is noisy
        rows.append(LabelRow(prompt_id, prompt_tokens, 4 * prompt_tokens, 1000, 0.0))
        rows += [LabelRow(prompt_id, prompt_tokens, int(scale * 2 * prompt_tokens), 1000, 1.0)
                 for scale in (0.3, 1.0, 1.0, 3.0)]
    labels = tmp_path / "labels.jsonl"
    _write_labels(labels, rows)
    config = predictor_bench.PredictorBenchConfig(label_paths=(labels,), prompt_paths=(prompts,),
                                                  kinds=("mean", "linear"), num_latency_batches=2)
    result = predictor_bench.run(config, tmp_path / "out.json")
    by_temperature = result["predictors"]["linear"]["by_temperature"]
    assert set(by_temperature) == {"0", "1"}
    sampled = by_temperature["1"]
    assert sampled["num_examples"] == 4 * sampled["num_prompts"]
    # The line in prompt length orders the prompts' medians exactly; single noisy draws much less so
    assert sampled["kendall_tau_vs_median"] > 0.95 > sampled["kendall_tau"] + 0.2
    assert result["predictors"]["mean"]["by_temperature"]["1"]["kendall_tau_vs_median"] == pytest.approx(0.0)


def test_a_probes_prefill_predictions_are_scored_on_every_sample_of_their_prompts():
    from predictor_service.length_example import LengthExample
    from predictor_service.length_predictor import LengthPrediction
    from predictor_service.training import LengthDataset

    uniform = tuple([0.1] * 10)
    examples = [LengthExample("a", "", 10, 100, 0.0), LengthExample("a", "", 10, 100, 1.0),
                LengthExample("a", "", 10, 100, 1.0), LengthExample("b", "", 10, 100, 1.0),
                LengthExample("c", "", 10, 100, 1.0)]  # no prediction for c: left out
    held_out = LengthDataset(examples, [50, 20, 40, 90, 5])
    scores = predictor_bench.prefill_scores_by_temperature(
        {"a": LengthPrediction(30, 60, uniform), "b": LengthPrediction(80, 85, uniform)}, held_out, max_len=100)
    assert (scores["0"]["num_examples"], scores["1"]["num_examples"], scores["1"]["num_prompts"]) == (1, 3, 2)
    assert scores["1"]["median_mae_tokens"] == pytest.approx((0 + 10) / 2)  # medians 30 and 90
    assert scores["1"]["under_reservation_rate"] == pytest.approx(1 / 3)  # 90 > 85
    assert scores["1"]["bucket_nll"] == pytest.approx(-np.log(0.1))


def test_the_per_temperature_table_appears_only_with_several_settings_or_samples():
    from predictor_service.length_example import LengthExample
    from predictor_service.training import LengthDataset

    greedy = LengthDataset([LengthExample("a", "", 10, 100, 0.0), LengthExample("b", "", 10, 100, 0.0)], [5, 6])
    assert not predictor_bench.has_samples(greedy)
    assert predictor_bench.has_samples(LengthDataset(greedy.examples + [LengthExample("a", "", 10, 100, 1.0)],
                                                     [5, 6, 7]))
    assert predictor_bench.has_samples(LengthDataset([LengthExample("a", "", 10, 100, 0.7)] * 2, [5, 9]))
