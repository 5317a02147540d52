"""Leave-one-source-out scoring (`bench predictor --split leave-source-out`) on synthetic labels and hidden states."""

import json
from pathlib import Path

import numpy as np
import pytest

from benchmarks.probe_bench import PROBE_VARIANTS
from benchmarks.predictor_bench import PredictorBenchConfig, load_prompt_texts_by_id, source_of
from benchmarks.source_folds import ALL_SOURCES, SourceFolds, averages, run
from predictor_service.hidden_features import HiddenFeatures
from predictor_service.length_example import LengthExample
from predictor_service.training import LengthDataset, split_by

MAX_LEN = 520


def _ids(source: str, count: int, stem: str = "pool") -> list[str]:
    return [f"{stem}:{source}-{i}" for i in range(count)]


def test_source_of_names_a_pool_set_or_the_prompt_file():
    assert source_of("pool:gpteacher_code-294") == "gpteacher_code" and source_of("pool:gsm8k-12") == "gsm8k"
    assert source_of("mt_bench_question:81") == "mt_bench_question"
    assert source_of("user_oriented_instructions:user_oriented_task_0") == "user_oriented_instructions"


def test_each_fold_trains_on_no_prompt_of_the_source_it_scores_nor_on_any_set_outside_the_pool():
    ids = (_ids("gsm8k", 40) + _ids("mbpp", 35) + _ids("oasst_seed", 5)
           + [f"mt_bench_question:{i}" for i in range(10)] + [f"vicuna_bench_question:{i}" for i in range(4)])
    plan = SourceFolds.plan(ids, min_fold_prompts=30)
    assert plan == SourceFolds(("gsm8k", "mbpp"), ("oasst_seed",), ("mt_bench_question", "vicuna_bench_question"))
    dataset = LengthDataset([LengthExample(i, "text", 10, 100) for i in ids], list(range(len(ids))))
    folds = plan.folds()
    assert [(name, sources) for name, _, sources in folds] == [
        ("gsm8k", ("gsm8k",)), ("mbpp", ("mbpp",)), (ALL_SOURCES, ("mt_bench_question", "vicuna_bench_question"))]
    for name, not_trained, sources in folds:
        train, held = split_by(dataset, not_trained)
        trained_sources = {source_of(e.prompt_id) for e in train.examples}
        assert not trained_sources & set(sources)
        assert not trained_sources & set(plan.never_trained)
        assert "oasst_seed" in trained_sources  # too small to score alone: always trained on
        assert {source_of(e.prompt_id) for e in held.examples} >= set(sources)
    assert {source_of(e.prompt_id) for e in split_by(dataset, folds[-1][1])[0].examples} == {
        "gsm8k", "mbpp", "oasst_seed"}  # the outside sets are scored by predictors trained on the whole pool
    with pytest.raises(ValueError, match="no source to hold out"):
        SourceFolds.plan(_ids("gsm8k", 10) + _ids("mbpp", 10), min_fold_prompts=30)
    with pytest.raises(ValueError, match="1 pool source.*--split prompt_id"):  # a fold would train on nothing
        SourceFolds.plan(_ids("gsm8k", 40) + ["mine:1", "mine:2"], min_fold_prompts=30)
    with pytest.raises(ValueError, match="0 pool source"):
        SourceFolds.plan(["mine:1", "mine:2"], min_fold_prompts=30)
    with pytest.raises(ValueError, match=r"named like pool sources \(gsm8k\)"):
        SourceFolds.plan(_ids("gsm8k", 40) + _ids("mbpp", 40) + ["gsm8k:7"], min_fold_prompts=30)


def test_averages_weigh_every_source_the_same_and_skip_missing_scores():
    by_source = {"a": {"p": {"kendall_tau": 0.2, "remaining_tau_at_256": None}},
                 "b": {"p": {"kendall_tau": 0.6, "remaining_tau_at_256": 0.5}, "q": {"kendall_tau": 1.0}}}
    means = averages(by_source)
    assert means["p"]["kendall_tau"] == pytest.approx(0.4) and means["p"]["num_sources"] == 2
    assert means["p"]["remaining_tau_at_256"] == pytest.approx(0.5)
    assert means["q"]["num_sources"] == 1 and means["q"]["mae_tokens"] is None


def _write_labels(path: Path, lengths: dict[str, int]) -> None:
    """Greedy labels whose answer length is 5 + 4 x the prompt's tokens."""
    path.write_text("".join(json.dumps({
        "prompt_id": prompt_id, "sample": 0, "prompt_tokens": (length - 5) // 4, "output_tokens": length,
        "finish_reason": "stop", "sampling": {"max_tokens": 500, "temperature": 0.0}}) + "\n"
        for prompt_id, length in lengths.items()))


def _features(lengths: dict[str, int], hidden_size: int = 16) -> HiddenFeatures:
    """Rows at 0, 64 and 128 decoded tokens whose state carries log(1 + remaining) along a fixed direction."""
    rng = np.random.default_rng(0)
    direction = rng.normal(size=hidden_size)
    direction /= np.linalg.norm(direction)
    rows = [(p, n) for p, total in lengths.items() for n in (0, 64, 128) if n < total]
    totals = np.array([lengths[p] for p, _ in rows], dtype=np.int64)
    decoded = np.array([n for _, n in rows], dtype=np.int64)
    hidden = rng.normal(size=(len(rows), hidden_size)) + 5 * np.log1p(totals - decoded)[:, None] * direction
    return HiddenFeatures(np.array([p for p, _ in rows]), np.full(len(rows), 20, dtype=np.int64), decoded,
                          np.full(len(rows), 500, dtype=np.int64), totals, hidden.astype(np.float16),
                          {"max_len": MAX_LEN})


def test_the_bench_scores_every_source_held_out_and_the_sets_outside_the_pool(shared_data: Path, tmp_path: Path):
    pool = shared_data / "prompts" / "pool.jsonl"
    texts = load_prompt_texts_by_id([pool])
    chosen = [p for source in ("gsm8k", "mbpp", "truthfulqa")
              for p in [q for q in texts if source_of(q) == source][:36]]
    extra = tmp_path / "extra_set.jsonl"
    extra.write_text("".join(json.dumps({"id": i, "prompt": f"question {i} " * (1 + i % 7)}) + "\n" for i in range(30)))
    chosen += [f"extra_set:{i}" for i in range(30)]
    # The answer's length follows the prompt's: the prompt-length line ranks it, the mean cannot
    lengths = {p: 5 + 4 * (10 + rank % 97) for rank, p in enumerate(chosen)}
    labels = tmp_path / "labels.jsonl"
    _write_labels(labels, lengths)
    features_path = tmp_path / "labels.hidden.npz"
    _features(lengths).save(features_path)
    config = PredictorBenchConfig((labels,), (pool, extra), kinds=("mean", "linear"), max_len=MAX_LEN,
                                  probe_features=(features_path,), split="leave-source-out")
    result = run(config, tmp_path / "out.json")

    assert result["folds"]["held_out_in_turn"] == ["gsm8k", "mbpp", "truthfulqa"]
    assert result["folds"]["never_trained"] == ["extra_set"]
    assert result["folds"]["sizes"]["gsm8k"]["num_train"] == 72  # the other two pool sources, never the extra set
    assert result["folds"]["sizes"][ALL_SOURCES]["num_train"] == 108
    by_source = result["by_source"]
    assert set(by_source) == {"gsm8k", "mbpp", "truthfulqa", "extra_set"}
    for source, per_predictor in by_source.items():
        assert set(per_predictor) == {"mean", "linear", *PROBE_VARIANTS}
        assert per_predictor["linear"]["num_examples"] == (30 if source == "extra_set" else 36)
        assert per_predictor["linear"]["kendall_tau"] > 0.8 > abs(per_predictor["mean"]["kendall_tau"]) + 0.5
        for probe in PROBE_VARIANTS:  # the synthetic states carry the length
            assert per_predictor[probe]["kendall_tau"] > 0.2
        assert per_predictor["probe"]["remaining_tau_at_64"] is not None
        assert per_predictor["probe"]["remaining_tau_at_256"] is None  # no row ran that far
    taus = [by_source[s]["linear"]["kendall_tau"] for s in by_source]
    assert result["average"]["linear"]["kendall_tau"] == pytest.approx(np.mean(taus))
    assert result["average_pool"]["linear"]["num_sources"] == 3
    assert json.loads((tmp_path / "out.json").read_text())["average"]["probe"]["num_sources"] == 4


def test_hidden_state_files_join_only_for_one_model_and_max_len():
    lengths = {f"pool:gsm8k-{i}": 100 + i for i in range(4)}
    first, second = _features(lengths), _features({f"pool:mbpp-{i}": 90 for i in range(3)})
    joined = HiddenFeatures.concatenate([first, second])
    assert len(joined) == len(first) + len(second) and joined.prompt_ids[-1] == "pool:mbpp-2"
    with pytest.raises(ValueError, match="cannot join those of max_len 520"):
        HiddenFeatures.concatenate([first, HiddenFeatures(*[getattr(second, f) for f in (
            "prompt_ids", "num_prompt_tokens", "num_output_tokens", "max_tokens", "output_tokens", "hidden")],
            {"max_len": 1024})])
    with pytest.raises(ValueError, match="a probe reads one model's states"):
        HiddenFeatures.concatenate([first, HiddenFeatures(*[getattr(second, f) for f in (
            "prompt_ids", "num_prompt_tokens", "num_output_tokens", "max_tokens", "output_tokens", "hidden")],
            {"max_len": 520, "model": "other"})])


def test_leave_source_out_refuses_an_artifact_and_unknown_kinds(tmp_path: Path):
    with pytest.raises(ValueError, match="cannot score --artifact"):
        run(PredictorBenchConfig((tmp_path / "l.jsonl",), (), artifact=tmp_path, split="leave-source-out"))
    with pytest.raises(ValueError, match="min_fold_prompts"):
        PredictorBenchConfig((), (), split="leave-source-out", min_fold_prompts=1)
