"""The text predictor's recipe: kinds scored by tau on sources held out in turn, prompts clustered when unnamed."""

import numpy as np
import pytest

import predictor_service.recipe as recipe
from predictor_service.length_example import LengthExample
from predictor_service.recipe import choose_recipe, holdout_sources, kind_of, leave_source_out_tau, prompt_clusters
from predictor_service.training import make_predictor

TOPICS = {"cook": "recipe pasta sauce garlic onion boil", "bank": "stock bond market interest rate loan",
          "code": "python function loop list return class"}


def examples_of(num_per_source: int) -> tuple[list[LengthExample], list[int], list[str]]:
    """Per source, answers that grow with the prompt; each source's words its own."""
    examples, lengths, sources = [], [], []
    for source, words in TOPICS.items():
        for i in range(num_per_source):
            num_prompt_tokens = 10 + (i * 13) % 97
            examples.append(LengthExample(f"{source}:{i}", f"{words} {words.split()[i % 6]} {i}", num_prompt_tokens,
                                          900))
            lengths.append(3 * num_prompt_tokens)
            sources.append(source)
    return examples, lengths, sources


def test_prompt_clusters_find_prompts_of_different_vocabularies():
    examples, _, sources = examples_of(15)
    clusters = prompt_clusters([e.prompt_text for e in examples], 3)
    assert len(set(clusters)) == 3
    for source in TOPICS:  # every source is one cluster of its own
        assert len({c for c, s in zip(clusters, sources) if s == source}) == 1
    assert prompt_clusters([e.prompt_text for e in examples], 3) == clusters  # seeded


def test_named_sources_are_kept_and_a_single_source_is_clustered():
    examples, _, sources = examples_of(25)
    assert holdout_sources(examples, sources, min_source_prompts=20) == sources
    clustered = holdout_sources(examples, ["one file"] * len(examples), min_source_prompts=20)
    assert all(name.startswith("cluster-") for name in clustered) and len(set(clustered)) >= 2
    with pytest.raises(ValueError, match="source names"):
        holdout_sources(examples, sources[:3])


def test_each_fold_is_fitted_without_the_source_it_scores(monkeypatch):
    examples, lengths, sources = examples_of(25)
    fitted_on = []

    def recording(kind, *args, **kwargs):
        predictor = make_predictor(kind, *args, **kwargs)
        fit = predictor.fit

        def fit_and_record(train, train_lengths):
            fitted_on.append({e.prompt_id.split(":")[0] for e in train})
            return fit(train, train_lengths)
        predictor.fit = fit_and_record
        return predictor

    monkeypatch.setattr(recipe, "make_predictor", recording)
    score = leave_source_out_tau("linear", examples, lengths, sources, min_source_prompts=20)
    assert sorted(score.tau_by_source) == sorted(TOPICS)
    assert [set(TOPICS) - seen for seen in fitted_on] == [{s} for s in sorted(TOPICS)]
    assert score.mean_tau == pytest.approx(np.mean(list(score.tau_by_source.values())))


def test_the_recipe_is_the_kind_that_ranks_unseen_sources_best():
    examples, lengths, sources = examples_of(25)
    best, scores = choose_recipe(("mean", "linear"), examples, lengths, sources, min_source_prompts=20)
    assert best.kind == "linear" and best.mean_tau > 0.95
    assert scores["mean"].mean_tau == 0.0  # a constant ranks nothing
    # Too few prompts per source: nothing is held out, no score, and the first kind stands.
    best, scores = choose_recipe(("mean", "linear"), examples, lengths, sources, min_source_prompts=30)
    assert best.kind == "mean" and best.mean_tau is None and scores["linear"].tau_by_source == {}


def test_a_kind_that_cannot_be_fitted_without_a_source_has_no_score():
    examples, lengths, sources = examples_of(25)  # every answer stops short of max_tokens: nothing to learn the cap of
    score = leave_source_out_tau("lightgbm_capped", examples, lengths, sources, min_source_prompts=20)
    assert score.mean_tau is None and "cannot be fitted without" in score.why_none
    assert kind_of(make_predictor("lightgbm_capped")) == "lightgbm_capped" and kind_of(make_predictor("linear")) == \
        "linear"
    with pytest.raises(ValueError, match="needs examples"):
        holdout_sources([])
