"""`bench predictor`'s probe rows and its split by source (synthetic hidden states; the real ones are the bench's)."""

import numpy as np
import pytest

from benchmarks import probe_bench
from benchmarks.predictor_bench import PredictorBenchConfig, check_features_match, run, source_of, split_dataset
from predictor_service.length_example import LengthExample
from predictor_service.training import LengthDataset


def _held(prompt_id: str) -> bool:
    return int(prompt_id.split(":")[1]) % 4 == 0


def test_every_probe_variant_is_scored_at_prefill_and_after_decoding(synthetic_probe_features):
    features = synthetic_probe_features(300, 16, seed=3)
    scores = probe_bench.score_probes(features, _held, max_len=520, quantile=0.9, num_latency_batches=2)
    results, sizes = scores.results, scores.sizes
    assert set(results) == set(probe_bench.PROBE_VARIANTS)
    assert sizes["num_held_out_prompts"] == 75 and sizes["num_train_rows"] + sizes["num_held_out_rows"] == len(features)
    for metrics in results.values():
        assert metrics["num_examples"] == 75  # one prefill row per held-out prompt
        assert metrics["kendall_tau"] > 0.6  # the synthetic states carry the length
        assert metrics["num_running_at_64"] == int(np.sum((features.num_output_tokens == 64)
                                                          & np.array([_held(p) for p in features.prompt_ids])))
        assert metrics["remaining_mae_tokens_at_64"] > 0 and metrics["prefill_remaining_mae_tokens_at_64"] > 0
        assert metrics["num_running_at_256"] == 0 and metrics["remaining_mae_tokens_at_256"] is None
        assert metrics["remaining_tau_at_0"] > 0.6 and metrics["remaining_tau_at_64"] > 0.3  # ranks what is left
        assert metrics["remaining_tau_at_256"] is None


def test_a_text_predictor_is_judged_at_the_same_points_by_its_prefill_estimate(synthetic_probe_features):
    features = synthetic_probe_features(40, 8, seed=4)
    exact = {p: int(t) for p, t in zip(features.prompt_ids, features.output_tokens)}
    scores = probe_bench.text_predictor_remaining(exact, features, _held)
    assert scores["remaining_mae_tokens_at_64"] == 0.0  # the exact total minus what was decoded is the remainder
    assert scores["remaining_mae_tokens_at_256"] is None  # no row has run that far
    off = probe_bench.text_predictor_remaining({p: t + 10 for p, t in exact.items()}, features, _held)
    assert off["remaining_mae_tokens_at_64"] == 10.0
    assert scores["remaining_tau_at_0"] == 1.0 and scores["remaining_tau_at_64"] == 1.0  # exact: a perfect order
    backwards = probe_bench.text_predictor_remaining({p: 1000 - t for p, t in exact.items()}, features, _held)
    assert backwards["remaining_tau_at_64"] == -1.0 and backwards["remaining_tau_at_256"] is None


def test_split_by_source_holds_out_whole_sets():
    assert source_of("pool:gpteacher_code-294") == "gpteacher_code" and source_of("pool:gsm8k-12") == "gsm8k"
    ids = ["pool:gsm8k-1", "pool:mbpp-2", "pool:humaneval-3", "pool:oasst-4", "pool:gsm8k-5"]
    dataset = LengthDataset([LengthExample(i, "text", 10, 100) for i in ids], [5, 6, 7, 8, 9])
    train, held = split_dataset(dataset, PredictorBenchConfig((), (), split="source"))
    assert [e.prompt_id for e in held.examples] == ["pool:gsm8k-1", "pool:humaneval-3", "pool:gsm8k-5"]
    assert held.lengths == [5, 7, 9] and [e.prompt_id for e in train.examples] == ["pool:mbpp-2", "pool:oasst-4"]
    with pytest.raises(ValueError, match="unknown split"):
        split_dataset(dataset, PredictorBenchConfig((), (), split="random"))
    with pytest.raises(ValueError, match="need both"):
        split_dataset(dataset, PredictorBenchConfig((), (), split="source", held_out_sources=("nowhere",)))


def test_features_of_other_prompts_or_another_max_len_are_refused(synthetic_probe_features):
    features = synthetic_probe_features(5, 8, seed=6)  # ids set:0 .. set:4, max_len 520
    dataset = LengthDataset([LengthExample(f"set:{i}", "text", 10, 100) for i in range(5)], [1] * 5)
    check_features_match(features, dataset, 520)  # the same prompts and max_len: fine
    with pytest.raises(ValueError, match="max_len 520"):
        check_features_match(features, dataset, 1024)
    with pytest.raises(ValueError, match="not in these labels"):
        check_features_match(features, LengthDataset(dataset.examples[:3], [1] * 3), 520)


def test_the_source_split_refuses_an_artifact_trained_without_it(tmp_path):
    config = PredictorBenchConfig((tmp_path / "labels.jsonl",), (), artifact=tmp_path, split="source")
    with pytest.raises(ValueError, match="--split source cannot score --artifact"):
        run(config)
