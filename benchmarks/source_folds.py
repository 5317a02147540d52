"""Leave-one-source-out scores of the length predictors, the standard score: `bench predictor --split leave-source-out`.

A predictor is only as useful as its ranking on traffic unlike anything it was trained on,
so every source set of the pool with at least `min_fold_prompts` labelled prompts is held out
in turn: the text predictors and the hidden-state probes are trained on every other pool
source and scored on this one. Smaller pool sources are always trained on. Prompt sets from
outside the pool (the instruction sets labelled beside it; their ids name their file) are never
trained on: each is scored by the predictors trained on the whole pool.

Per source and predictor, on the source's greedy answers (the probes read greedy states):
Kendall tau-b (ties counted) of the total length at the prefill, 10-bucket accuracy, MAE,
under-reservation, and the tau-b and MAE of the remaining length after 64, 128 and 256 decoded
tokens, re-predicted by the probes, the text predictors' prefill point minus what was decoded.
The average is the unweighted mean over the sources scored: each source counts the same,
however many prompts it has.
"""

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np
from tqdm import tqdm

from benchmarks import probe_bench
from benchmarks.predictor_bench import (KINDS, PredictorBenchConfig, check_features_match, is_pool_prompt,
                                        load_features, load_prompt_texts_by_id, source_of)
from benchmarks.report import environment, format_table, write_json
from predictor_service.features import FeatureConfig
from predictor_service.hidden_features import HiddenFeatures
from predictor_service.metrics import evaluate
from predictor_service.training import LengthDataset, build_dataset, make_predictor, read_labels, split_by

# The text kinds trained per fold unless asked: the transformer fine-tunes for minutes, once per fold
FOLD_KINDS = ("mean", "linear", "lightgbm")
ALL_SOURCES = "(all pool sources)"  # the fold that trains on the whole pool and scores the sets outside it
SCORES = ("kendall_tau", "bucket_accuracy", "mae_tokens", "under_reservation_rate",
          *(f"remaining_tau_at_{n}" for n in probe_bench.REPREDICTION_POINTS),
          *(f"remaining_mae_tokens_at_{n}" for n in probe_bench.REPREDICTION_POINTS))


@dataclass(frozen=True, slots=True)
class SourceFolds:
    """Which sources are held out in turn, which are always trained on and which never are.

    Attributes:
        held_out_in_turn: pool sources with at least `min_fold_prompts` prompts, largest first.
        always_trained: pool sources too small to score on their own.
        never_trained: sets outside the pool, scored by the fold trained on the whole pool.
    """

    held_out_in_turn: tuple[str, ...]
    always_trained: tuple[str, ...]
    never_trained: tuple[str, ...]

    @classmethod
    def plan(cls, prompt_ids: Sequence[str], min_fold_prompts: int) -> "SourceFolds":
        prompts_of = Counter(source_of(p) for p in set(prompt_ids) if is_pool_prompt(p))
        outside = sorted({source_of(p) for p in prompt_ids if not is_pool_prompt(p)})
        if len(prompts_of) < 2:
            raise ValueError(f"leave-source-out trains on the pool's other sources, and these labels hold "
                             f"{len(prompts_of)} pool source(s): score them with --split prompt_id")
        if set(outside) & set(prompts_of):
            clash = ", ".join(sorted(set(outside) & set(prompts_of)))
            raise ValueError(f"prompt files named like pool sources ({clash}) would be scored as one source: rename "
                             "the files")
        big = tuple(s for s, n in sorted(prompts_of.items(), key=lambda kv: (-kv[1], kv[0])) if n >= min_fold_prompts)
        small = tuple(sorted(s for s in prompts_of if s not in big))
        if not big and not outside:
            raise ValueError(f"no source to hold out: no pool source has {min_fold_prompts} labelled prompts and no "
                             "prompt comes from outside the pool (pass --min-fold-prompts lower, more labels, or "
                             "--split prompt_id)")
        return cls(big, small, tuple(outside))

    def folds(self) -> list[tuple[str, Callable[[str], bool], tuple[str, ...]]]:
        """(fold name, which prompts it does not train on, the sources it scores) per fold."""
        folds = [(source, _not_trained_without(source), (source,)) for source in self.held_out_in_turn]
        if self.never_trained:
            folds.append((ALL_SOURCES, _not_trained_without(None), self.never_trained))
        return folds


def _not_trained_without(source: str | None) -> Callable[[str], bool]:
    """Prompts a fold leaves out of training: those of `source`, and every prompt from outside the pool."""
    return lambda prompt_id: not is_pool_prompt(prompt_id) or source_of(prompt_id) == source


def _only(dataset: LengthDataset, source: str) -> LengthDataset:
    """The greedy rows of one source."""
    rows = [i for i, e in enumerate(dataset.examples) if source_of(e.prompt_id) == source and e.temperature == 0.0]
    return LengthDataset([dataset.examples[i] for i in rows], [dataset.lengths[i] for i in rows])


def score_fold(config: PredictorBenchConfig, kinds: Sequence[str], train: LengthDataset, held_out: LengthDataset,
               features: HiddenFeatures | None, not_trained: Callable[[str], bool],
               sources: Sequence[str]) -> dict[str, dict[str, dict]]:
    """Fit every predictor on `train` (and the probes on the features of the prompts `not_trained` keeps) and score
    it on each of `sources`' greedy rows: source -> predictor -> scores."""
    scores: dict[str, dict[str, dict]] = {source: {} for source in sources}
    for kind in kinds:
        predictor = make_predictor(kind, config.quantile, config.max_len,
                                   FeatureConfig(use_embedding=config.use_embedding))
        predictor.fit(train.examples, train.lengths)
        for source in sources:
            rows = _only(held_out, source)
            if len(rows.examples) < 3:
                continue
            predictions = predictor.predict_examples(rows.examples)
            metrics = evaluate(predictions, rows.lengths, config.max_len)
            if features is not None:
                points = {e.prompt_id: p.point_tokens for e, p in zip(rows.examples, predictions)}
                metrics |= probe_bench.text_predictor_remaining(points, features, lambda p, s=source: source_of(p) == s)
            scores[source][kind] = metrics
    held = np.array([not_trained(p) for p in features.prompt_ids], dtype=bool) if features is not None else None
    if features is not None and held.any() and not held.all():  # sources without rows are left unscored
        train_rows, test_rows = features.take(~held), features.take(held)
        for name, (probe, _) in probe_bench.fit_probes(train_rows, config.max_len, config.quantile).items():
            for source in sources:
                rows = test_rows.take(np.array([source_of(p) == source for p in test_rows.prompt_ids], dtype=bool))
                if int(np.sum(rows.num_output_tokens == 0)) >= 3:
                    scores[source][name] = probe_bench.probe_metrics(probe, rows, config.max_len)[0]
    return scores


def averages(by_source: dict[str, dict[str, dict]]) -> dict[str, dict]:
    """Predictor -> the unweighted mean of each score over the sources that have it (None where none has), with
    how many sources each mean covers (a remaining-length tau needs 3 answers still going)."""
    names = list(dict.fromkeys(name for per_source in by_source.values() for name in per_source))
    out = {}
    for name in names:
        rows = [per_source[name] for per_source in by_source.values() if name in per_source]
        out[name] = {"num_sources": len(rows), "num_sources_by_score": {}}
        for key in SCORES:
            values = [row[key] for row in rows if row.get(key) is not None]
            out[name][key] = float(np.mean(values)) if values else None
            out[name]["num_sources_by_score"][key] = len(values)
    return out


def run(config: PredictorBenchConfig, json_path=None) -> dict:
    """Hold out each source in turn; print the per-source and average tables and write JSON."""
    if config.artifact is not None:
        raise ValueError("--split leave-source-out cannot score --artifact: an artifact was trained on every source "
                         "(score it with --split prompt_id)")
    rows = read_labels(config.label_paths)
    dataset = build_dataset(rows, load_prompt_texts_by_id(config.prompt_paths))
    plan = SourceFolds.plan([e.prompt_id for e in dataset.examples], config.min_fold_prompts)
    kinds = tuple(config.kinds) if config.kinds is not None else FOLD_KINDS
    unknown = [kind for kind in kinds if kind not in KINDS]
    if unknown:
        raise ValueError(f"unknown predictor kinds {unknown}; choose from {', '.join(KINDS)}")
    features = None
    if config.probe_features:
        features = load_features(config.probe_features)
        check_features_match(features, dataset, config.max_len)
    print(f"{len(rows)} label rows, {len(dataset.examples)} joined to prompts; held out in turn: "
          f"{', '.join(plan.held_out_in_turn) or 'none'}; always trained on (under {config.min_fold_prompts} "
          f"prompts): {', '.join(plan.always_trained) or 'none'}; never trained on: "
          f"{', '.join(plan.never_trained) or 'none'}", flush=True)

    by_source: dict[str, dict[str, dict]] = {}
    fold_sizes = {}
    for fold, not_trained, sources in tqdm(plan.folds(), desc="folds", unit="fold"):
        train, held_out = split_by(dataset, not_trained)
        fold_sizes[fold] = {"num_train": len(train.examples),
                            "num_scored": {s: len(_only(held_out, s).examples) for s in sources}}
        by_source |= score_fold(config, kinds, train, held_out, features, not_trained, sources)
    mean = averages(by_source)
    pool_mean = averages({s: v for s, v in by_source.items() if s in plan.held_out_in_turn})

    headers = ["source", "prompts", "predictor", "tau", "bucket_acc", "mae_tok", "under_rate",
               *(f"tau_at_{n}" for n in probe_bench.REPREDICTION_POINTS)]
    keys = ("kendall_tau", "bucket_accuracy", "mae_tokens", "under_reservation_rate",
            *(f"remaining_tau_at_{n}" for n in probe_bench.REPREDICTION_POINTS))
    table = [[source, next(iter(per_source.values()))["num_examples"] if per_source else 0, name,
              *(metrics.get(key) for key in keys)]
             for source, per_source in by_source.items() for name, metrics in per_source.items()]
    print(format_table(headers, table))
    print("averages over sources (each source counts the same): every source scored, and the pool's sources alone")
    print(format_table(["over", "sources", "predictor", *headers[3:]],
                       [[over, m["num_sources"], name, *(m[key] for key in keys)]
                        for over, means in (("all", mean), ("pool", pool_mean)) for name, m in means.items()]))
    result = {
        "config": {"split": config.split, "kinds": list(kinds), "max_len": config.max_len,
                   "quantile": config.quantile, "use_embedding": config.use_embedding,
                   "min_fold_prompts": config.min_fold_prompts,
                   "label_paths": [str(p) for p in config.label_paths],
                   "prompt_paths": [str(p) for p in config.prompt_paths],
                   "probe_features": [str(p) for p in config.probe_features]},
        "folds": {key: list(value) for key, value in asdict(plan).items()} | {"sizes": fold_sizes},
        "environment": environment(),
        "by_source": by_source,
        "average": mean,
        "average_pool": pool_mean,
    }
    write_json(json_path, result)
    return result
