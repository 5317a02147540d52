"""Baselines, LightGBM, artifacts and the training pipeline, on real prompts with synthetic lengths."""

import json
import re
import shutil
from pathlib import Path

import pytest

from benchmarks.predictor_bench import load_prompt_texts_by_id
from predictor_service.artifacts import load_predictor, read_manifest
from predictor_service.baselines import MeanLengthPredictor, PromptLengthLinearPredictor
from predictor_service.features import FeatureConfig, FeatureExtractor, hashed_ngrams
from predictor_service.length_example import LengthExample
from predictor_service.length_predictor import LengthQuery
from predictor_service.lightgbm_predictor import BoosterConfig, LightGBMLengthPredictor
from predictor_service.metrics import evaluate
from predictor_service.training import (
    LabelRow,
    build_dataset,
    labelled_model,
    make_predictor,
    read_labels,
    split_by_prompt_id,
    train_predictor,
)

MAX_LEN = 1024
NUM_PROMPTS = 400


def make_example(prompt_id: str = "p:1", text: str = "hello world", num_prompt_tokens: int = 10,
                 max_tokens: int = 1000) -> LengthExample:
    return LengthExample(prompt_id, text, num_prompt_tokens, max_tokens, 0.0)


def synthetic_rows(texts: dict[str, str]) -> list[LabelRow]:
    """Label rows whose length is 5 tokens per word of the prompt (clipped), prompt length loosely tied to it."""
    rows = []
    for prompt_id, text in list(texts.items())[:NUM_PROMPTS]:
        num_words = len(re.findall(r"\w+", text))
        num_prompt_tokens = min(MAX_LEN // 2, 20 + num_words // 3)
        max_tokens = MAX_LEN - num_prompt_tokens
        rows.append(LabelRow(prompt_id, num_prompt_tokens, max(1, min(max_tokens, 5 * num_words)), max_tokens, 0.0))
    return rows


@pytest.fixture(scope="module")
def prompt_texts(shared_data: Path) -> dict[str, str]:
    return load_prompt_texts_by_id([shared_data / "prompts" / "pool.jsonl"])


@pytest.fixture(scope="module")
def dataset(prompt_texts):
    return build_dataset(synthetic_rows(prompt_texts), prompt_texts)


def small_lightgbm() -> LightGBMLengthPredictor:
    return LightGBMLengthPredictor(FeatureConfig(num_hash_dims=64), quantile=0.9, max_len=MAX_LEN,
                                   booster_config=BoosterConfig(num_rounds=80, num_bucket_rounds=20))


def test_mean_baseline_predicts_the_mean_and_the_quantile_clamped_to_max_tokens():
    examples = [make_example(f"p:{i}") for i in range(4)]
    predictor = MeanLengthPredictor(quantile=0.9, max_len=100).fit(examples, [10, 20, 30, 40])
    first, clamped = predictor.predict_examples([make_example(), make_example(max_tokens=20)])
    assert (first.point_tokens, first.upper_bound_tokens) == (25, 37)
    assert (clamped.point_tokens, clamped.upper_bound_tokens) == (20, 20)
    assert first.bucket_probs == pytest.approx((0.25, 0.25, 0.25, 0.25, 0, 0, 0, 0, 0, 0))


def test_linear_baseline_recovers_a_line_and_adds_the_residual_quantile():
    examples = [make_example(f"p:{i}", num_prompt_tokens=n) for i, n in enumerate((10, 20, 30, 40, 50))]
    predictor = PromptLengthLinearPredictor(quantile=0.9, max_len=MAX_LEN).fit(examples, [25, 45, 65, 85, 105])
    [prediction] = predictor.predict([LengthQuery("q", tuple(range(60)), max_tokens=500)])
    assert prediction.point_tokens == 125
    assert prediction.upper_bound_tokens == 125  # zero residuals
    assert sum(prediction.bucket_probs) == pytest.approx(1.0)
    assert max(range(10), key=lambda i: prediction.bucket_probs[i]) == 1  # 125 is in (102, 205]


def test_unfitted_predictors_and_bad_settings_raise_clear_errors():
    with pytest.raises(ValueError, match="not fitted"):
        MeanLengthPredictor().predict_examples([make_example()])
    with pytest.raises(ValueError, match="quantile must be in"):
        PromptLengthLinearPredictor(quantile=1.5)
    with pytest.raises(ValueError, match="unknown predictor kind 'oracle'"):
        make_predictor("oracle")
    with pytest.raises(ValueError, match="2 examples for 1 lengths"):
        MeanLengthPredictor().fit([make_example(), make_example()], [3])


def test_hashed_features_are_deterministic_and_fixed_width():
    config = FeatureConfig(num_hash_dims=32)
    matrix = FeatureExtractor(config).transform([make_example(text="Write a poem. Write a poem!")])
    assert matrix.shape == (1, config.num_features)
    assert hashed_ngrams("Write a poem", 32).sum() == 5  # 3 words + 2 bigrams
    assert (hashed_ngrams("write a poem", 32) == hashed_ngrams("WRITE a  poem", 32)).all()


def test_dataset_joins_on_prompt_id_and_reports_missing_prompts(prompt_texts):
    rows = synthetic_rows(prompt_texts)[:3] + [LabelRow("pool:not-a-prompt", 5, 7, 100, 0.0)]
    dataset = build_dataset(rows, prompt_texts)
    assert len(dataset.examples) == 3
    assert dataset.missing_prompt_ids == ["pool:not-a-prompt"]
    with pytest.raises(ValueError, match="none of the 1 label rows matches a prompt"):
        build_dataset([LabelRow("other:1", 5, 7, 100, 0.0)], prompt_texts)


def test_split_is_deterministic_and_keeps_a_prompt_on_one_side(dataset):
    train, held_out = split_by_prompt_id(dataset)
    again_train, _ = split_by_prompt_id(dataset)
    assert [e.prompt_id for e in train.examples] == [e.prompt_id for e in again_train.examples]
    assert not {e.prompt_id for e in train.examples} & {e.prompt_id for e in held_out.examples}
    assert 0.1 < len(held_out.examples) / len(dataset.examples) < 0.3


def test_read_labels_skips_a_half_written_last_line(tmp_path: Path):
    row = {"prompt_id": "pool:a", "sample": 0, "prompt_tokens": 9, "output_tokens": 4, "finish_reason": "stop",
           "sampling": {"max_tokens": 1015, "temperature": 0.0}, "model": "m", "max_len": 1024}
    path = tmp_path / "labels.jsonl"
    path.write_text(json.dumps(row) + "\n" + '{"prompt_id": "pool:b", "sam')
    assert read_labels([path]) == [LabelRow("pool:a", 9, 4, 1015, 0.0, model="m")]
    path.write_text('{"prompt_id": "pool:a"}\n')
    with pytest.raises(ValueError, match="labels.jsonl:1: not a label row"):
        read_labels([path])


def test_lightgbm_beats_the_mean_baseline_on_held_out_prompts(dataset):
    train, held_out = split_by_prompt_id(dataset)
    learned = small_lightgbm().fit(train.examples, train.lengths)
    mean = MeanLengthPredictor(max_len=MAX_LEN).fit(train.examples, train.lengths)
    learned_metrics = evaluate(learned.predict_examples(held_out.examples), held_out.lengths, MAX_LEN)
    mean_metrics = evaluate(mean.predict_examples(held_out.examples), held_out.lengths, MAX_LEN)
    assert learned_metrics["kendall_tau"] > 0.5 > mean_metrics["kendall_tau"]
    assert learned_metrics["mae_tokens"] < mean_metrics["mae_tokens"]
    for prediction, example in zip(learned.predict_examples(held_out.examples), held_out.examples):
        assert 1 <= prediction.point_tokens <= prediction.upper_bound_tokens <= example.max_tokens
        assert sum(prediction.bucket_probs) == pytest.approx(1.0)


def test_lightgbm_predict_needs_a_text_source():
    predictor = small_lightgbm().fit([make_example(f"p:{i}", text="word " * i) for i in range(30)], list(range(30)))
    query = LengthQuery("p:3", tuple(range(10)), max_tokens=100)
    with pytest.raises(ValueError, match="needs prompt text"):
        predictor.predict([query])
    predictor.text_of = lambda q: "word word word"
    assert len(predictor.predict([query])) == 1


@pytest.mark.parametrize("kind", ["mean", "linear", "lightgbm"])
def test_artifact_round_trip_gives_identical_predictions(dataset, tmp_path: Path, kind: str):
    config = FeatureConfig(num_hash_dims=64)
    result = train_predictor(dataset, kind, max_len=MAX_LEN, feature_config=config, out_dir=tmp_path)
    assert result.artifact_dir == tmp_path / "v0001"
    loaded = load_predictor(tmp_path)  # through LATEST
    examples = dataset.examples[:50]
    assert loaded.predict_examples(examples) == result.predictor.predict_examples(examples)
    assert read_manifest(tmp_path)["kind"] == kind
    assert json.loads((result.artifact_dir / "metrics.json").read_text())["kendall_tau"] == pytest.approx(
        result.metrics["kendall_tau"])


def test_corrupt_or_incomplete_artifacts_are_refused(dataset, tmp_path: Path):
    directory = train_predictor(dataset, "lightgbm", feature_config=FeatureConfig(num_hash_dims=16),
                                out_dir=tmp_path / "root").artifact_dir
    corrupt = tmp_path / "corrupt"
    shutil.copytree(directory, corrupt)
    (corrupt / "point.lgb.txt").write_text("not a model\n")
    with pytest.raises(ValueError, match="point.lgb.txt is not a LightGBM model file"):
        load_predictor(corrupt)
    (corrupt / "upper.lgb.txt").unlink()
    with pytest.raises(ValueError, match="missing: upper.lgb.txt"):
        load_predictor(corrupt)
    manifest = json.loads((directory / "manifest.json").read_text())
    (directory / "manifest.json").write_text(json.dumps(manifest | {"kind": "oracle"}))
    with pytest.raises(ValueError, match="unknown predictor kind 'oracle'"):
        load_predictor(directory)
    with pytest.raises(ValueError, match="neither manifest.json nor LATEST"):
        load_predictor(tmp_path)


@pytest.mark.slow
def test_minilm_embedding_columns_are_appended(tmp_path: Path):
    config = FeatureConfig(num_hash_dims=8, use_embedding=True, embedding_batch_size=2)
    matrix = FeatureExtractor(config).transform([make_example(text="a cat"), make_example(text="a dog"),
                                                 make_example(text="quantum chromodynamics")])
    assert matrix.shape == (3, config.num_features)
    assert abs((matrix[0, -384:] ** 2).sum() - 1.0) < 1e-4


def test_an_artifact_names_the_model_whose_lengths_it_learnt(dataset, tmp_path: Path):
    from predictor_service.artifacts import trained_for
    from predictor_service.server import DEFAULT_ARTIFACT_ROOT

    train_predictor(dataset, "mean", max_len=MAX_LEN, out_dir=tmp_path / "a", model="gemma3-270m")
    assert trained_for(tmp_path / "a") == "gemma3-270m"
    train_predictor(dataset, "mean", max_len=MAX_LEN, out_dir=tmp_path / "b")
    assert trained_for(tmp_path / "b") is None  # labels that did not say
    assert trained_for(DEFAULT_ARTIFACT_ROOT) == "smollm2-135m-instruct"
    m1, m2 = LabelRow("p:1", 10, 5, 100, 0.0, model="m1"), LabelRow("p:2", 10, 5, 100, 0.0, model="m2")
    assert labelled_model([m1, m1]) == "m1"
    assert labelled_model([m1, m2]) is None and labelled_model([LabelRow("p:3", 10, 5, 100, 0.0)]) is None


def test_train_predictor_and_bench_predictor_commands(prompt_texts, shared_data: Path, tmp_path: Path):
    import subprocess
    import sys

    labels = tmp_path / "labels.jsonl"
    labels.write_text("".join(
        json.dumps({"prompt_id": r.prompt_id, "sample": 0, "prompt_tokens": r.num_prompt_tokens,
                    "output_tokens": r.num_output_tokens, "finish_reason": "stop",
                    "sampling": {"max_tokens": r.max_tokens, "temperature": 0.0},
                    "model": "smollm2-135m-instruct"}) + "\n"
        for r in synthetic_rows(prompt_texts)[:200]))
    common = ["--labels", str(labels), "--prompts", str(shared_data / "prompts" / "pool.jsonl")]
    train = subprocess.run([sys.executable, "-m", "s3serve_cli.main", "train-predictor", *common, "--kind", "lightgbm",
                            "--no-embedding", "--out", str(tmp_path / "art")],
                           capture_output=True, text=True, timeout=300)
    assert train.returncode == 0, train.stderr[-2000:]
    assert (tmp_path / "art" / "LATEST").is_file()
    assert read_manifest(tmp_path / "art")["model"] == "smollm2-135m-instruct"  # the rows' model
    bench = subprocess.run([sys.executable, "-m", "s3serve_cli.main", "bench", "predictor", *common, "--no-embedding",
                            "--artifact", str(tmp_path / "art"), "--json", str(tmp_path / "out.json")],
                           capture_output=True, text=True, timeout=300)
    assert bench.returncode == 0, bench.stderr[-2000:]
    data = json.loads((tmp_path / "out.json").read_text())
    assert {"mean", "linear"} <= set(data["predictors"])
    for metrics in data["predictors"].values():
        for key in ("kendall_tau", "bucket_accuracy", "mae_tokens", "under_reservation_rate",
                    "mean_over_reservation_tokens", "latency_p99_ms_batch1", "latency_p99_ms_batch32"):
            assert key in metrics
    learned = [name for name in data["predictors"] if name not in ("mean", "linear")]
    assert learned and data["predictors"][learned[0]]["kendall_tau"] > data["predictors"]["mean"]["kendall_tau"]
