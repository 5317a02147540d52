"""Output-length predictors side by side on the held-out prompts of a labels file.

Trains the mean and prompt-length baselines, LightGBM and the fine-tuned transformer
on the train side of the prompt-id hash split (`kinds` picks which; an artifact can
be scored as well) and reports, for each, ranking quality, bucket accuracy, error,
reservation cost and latency. For conformally calibrated predictors it also reports
what the raw (uncalibrated) bound would have cost: under-reservation and over-reservation.
Latency is that of `predict_examples` on prompt text already looked up.

With hidden-state features (`probe_features`, the engine's own rows from `s3serve probe
extract`; by default those beside each labels file) the hidden-state probes are trained on the same
train side and scored on the same held-out prompts (`benchmarks.probe_bench`), with their
re-predictions after 64, 128 and 256 decoded tokens. `split="source"` holds out whole source
sets of the pool instead of a hash of the prompt id: traffic unlike anything trained on.
"""

import copy
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from benchmarks import probe_bench
from benchmarks.prompt_pool import DEFAULT_PROMPTS, read_prompts
from benchmarks.report import environment, format_table, write_json
from cluster.config import service_default
from predictor_service.artifacts import load_predictor, read_manifest
from predictor_service.features import FeatureConfig
from predictor_service.hidden_features import HiddenFeatures
from predictor_service.kinds import CAPPED_LIGHTGBM
from predictor_service.length_example import FittedLengthPredictor
from predictor_service.metrics import distribution_metrics, evaluate
from predictor_service.recipe import MIN_SOURCE_PROMPTS
from predictor_service.server import SHIPPED_LABEL_FILES
from predictor_service.training import (LengthDataset, build_dataset, is_held_out, make_predictor,
                                        read_labels, split_by)

METRICS = ("kendall_tau", "bucket_accuracy", "mae_tokens", "under_reservation_rate", "mean_over_reservation_tokens")
LATENCY_BATCH_SIZES = (1, 32)
KINDS = ("mean", "linear", "lightgbm", "transformer", CAPPED_LIGHTGBM)
DEFAULT_KINDS = ("mean", "linear", "lightgbm", "transformer")  # one split's default rows
BASELINES = ("mean", "linear")
LEAVE_SOURCE_OUT = "leave-source-out"  # the standard: `benchmarks.source_folds`
SPLITS = ("prompt_id", "source", LEAVE_SOURCE_OUT)
POOL_STEM = "pool"  # the shared pool's file name, the part of its prompt ids before the colon
# The labels and prompts `bench predictor` scores by default: the shipped ones, the pool's (those the shipped
# predictors trained on, and more greedy ones that bring each pool source to 250 prompts or all it has) and the four
# instruction sets' beside it; no shipped predictor trained on the last two files
INSTRUCTION_SETS = ("vicuna_bench_question", "mt_bench_question", "seed_tasks", "user_oriented_instructions")
DEFAULT_LABELS = (*SHIPPED_LABEL_FILES,
                  SHIPPED_LABEL_FILES[0].with_name("smollm2-135m-instruct.pool-even.greedy.jsonl"),
                  SHIPPED_LABEL_FILES[0].with_name("smollm2-135m-instruct.instructions.greedy.jsonl"))
DEFAULT_PROMPT_FILES = (DEFAULT_PROMPTS, *(DEFAULT_PROMPTS.with_name(f"{name}.jsonl") for name in INSTRUCTION_SETS))
# Held out by `split="source"`: maths word problems, open chat and code completion (30% of the pool's labels)
HELD_OUT_SOURCES = ("gsm8k", "arenahard", "humaneval")


@dataclass(frozen=True, slots=True)
class PredictorBenchConfig:
    """What `s3serve bench predictor` runs.

    Attributes:
        label_paths: labels JSONL files written by `s3serve label`.
        prompt_paths: the prompt files the labels were made from.
        artifact: a saved predictor to score as well, reported as "artifact".
        kinds: predictor kinds trained here; None means DEFAULT_KINDS, or only the baselines with an artifact.
        max_len: longest sequence; the 10 buckets span [0, max_len].
        quantile: the upper bound's coverage target.
        use_embedding: give the LightGBM trained here the MiniLM embedding.
        held_out_fraction: share of prompts (by id hash) held out for scoring.
        num_latency_batches: timed batches per batch size.
        probe_features: files of hidden-state rows for the probes, joined (empty: no probe rows).
        split: "prompt_id" (a hash of the id, `held_out_fraction`), "source" (`held_out_sources`) or
            "leave-source-out" (every source held out in turn: `benchmarks.source_folds`, the standard).
        held_out_sources: source sets (the part of a pool id before the number) held out by the source split.
        min_fold_prompts: the leave-source-out split holds out a pool source only if it has this many labelled
            prompts; smaller ones are always trained on.
    """

    label_paths: tuple[Path, ...]
    prompt_paths: tuple[Path, ...]
    artifact: Path | None = None
    kinds: tuple[str, ...] | None = None
    max_len: int = 1024
    quantile: float = service_default("quantile")
    use_embedding: bool = True
    held_out_fraction: float = 0.2
    num_latency_batches: int = 50
    probe_features: tuple[Path, ...] = ()
    split: str = "prompt_id"
    held_out_sources: tuple[str, ...] = HELD_OUT_SOURCES
    min_fold_prompts: int = MIN_SOURCE_PROMPTS

    def __post_init__(self) -> None:
        if self.split not in SPLITS:
            raise ValueError(f"unknown split {self.split!r}; choose from {', '.join(SPLITS)}")
        if self.min_fold_prompts < 3:
            raise ValueError(f"min_fold_prompts must be >= 3 (Kendall tau needs pairs), got {self.min_fold_prompts}")

    def is_held_out(self, prompt_id: str) -> bool:
        if self.split == "source":
            return source_of(prompt_id) in self.held_out_sources
        return is_held_out(prompt_id, self.held_out_fraction)


def source_of(prompt_id: str) -> str:
    """The source set of a prompt id: a pool prompt's set ("pool:gsm8k-12" -> "gsm8k"), any other prompt's file
    ("mt_bench_question:81" -> "mt_bench_question", as `read_prompts` names them)."""
    stem, colon, native = prompt_id.partition(":")
    if not colon or stem == POOL_STEM:
        return (native or stem).rsplit("-", 1)[0]
    return stem


def is_pool_prompt(prompt_id: str) -> bool:
    """Whether the prompt comes from the shared pool (the predictors' training sources)."""
    return prompt_id.startswith(f"{POOL_STEM}:")


def check_features_match(features: HiddenFeatures, dataset: LengthDataset, max_len: int) -> None:
    """Refuse hidden-state rows that are not of these labels' prompts and max_len (they would score other prompts)."""
    if int(features.meta.get("max_len", -1)) != max_len:
        raise ValueError(f"the probe features were extracted at max_len {features.meta.get('max_len')}, the bench "
                         f"runs at {max_len}: pass --max-len {features.meta.get('max_len')} or other features")
    missing = sorted(set(features.prompt_ids.tolist()) - {e.prompt_id for e in dataset.examples})
    if missing:
        raise ValueError(f"{len(missing)} prompts of the probe features are not in these labels (e.g. {missing[0]}): "
                         "extract features from these labels with `s3serve probe extract`, or pass --no-probe")


def load_features(paths: Sequence[Path]) -> HiddenFeatures:
    """The hidden-state rows of every file, joined."""
    return HiddenFeatures.concatenate([HiddenFeatures.load(path) for path in paths])


def split_dataset(dataset: LengthDataset, config: PredictorBenchConfig) -> tuple[LengthDataset, LengthDataset]:
    """(train, held_out) by the config's split; every sample of one prompt lands on the same side."""
    if config.split == LEAVE_SOURCE_OUT:
        raise ValueError(f"{LEAVE_SOURCE_OUT} is not one train/held-out split: benchmarks.source_folds.run scores it")
    train, held_out = split_by(dataset, config.is_held_out)
    if not train.examples or not held_out.examples:
        raise ValueError(f"the {config.split} split leaves {len(train.examples)} train and "
                         f"{len(held_out.examples)} held-out examples: need both")
    return train, held_out


def load_prompt_texts_by_id(paths: Sequence[Path | str]) -> dict[str, str]:
    """Prompt id -> the prompt's message contents joined, over every prompt file."""
    return {
        record.prompt_id: record.text
        for path in paths for record in read_prompts(path)
    }


def scores_by_temperature(predictions: Sequence, held_out: LengthDataset, max_len: int) -> dict[str, dict]:
    """The held-out scores per sampling temperature, with the per-prompt distribution scores (several samples)."""
    rows_of: dict[float, list[int]] = defaultdict(list)
    for index, example in enumerate(held_out.examples):
        rows_of[example.temperature].append(index)
    scores = {}
    for temperature, rows in sorted(rows_of.items()):
        group = [predictions[index] for index in rows]
        lengths = [held_out.lengths[index] for index in rows]
        prompt_ids = [held_out.examples[index].prompt_id for index in rows]
        scores[f"{temperature:g}"] = (evaluate(group, lengths, max_len)
                                      | distribution_metrics(group, lengths, prompt_ids, max_len))
    return scores


def prefill_scores_by_temperature(prediction_by_prompt: dict, held_out: LengthDataset, max_len: int) -> dict:
    """`scores_by_temperature` of one prediction per prompt (a probe's, made at the prefill) on the held-out rows of
    those prompts, whatever their sampling settings."""
    rows = [index for index, example in enumerate(held_out.examples) if example.prompt_id in prediction_by_prompt]
    subset = LengthDataset([held_out.examples[index] for index in rows], [held_out.lengths[index] for index in rows])
    return scores_by_temperature([prediction_by_prompt[example.prompt_id] for example in subset.examples], subset,
                                 max_len)


def has_samples(held_out: LengthDataset) -> bool:
    """Whether the held-out rows hold more than one sampling temperature or several samples of a prompt."""
    keys = [(example.prompt_id, example.temperature) for example in held_out.examples]
    return len({temperature for _, temperature in keys}) > 1 or len(set(keys)) < len(keys)


def _latency_ms(predictor: FittedLengthPredictor, examples: list, batch_size: int, num_batches: int) -> dict:
    """p50 and p99 wall time of one predict_examples call on `batch_size` examples, in ms."""
    predictor.predict_examples(examples[:batch_size])  # warm-up: lazy model loads are not latency
    times_ms = []
    for index in range(num_batches):
        start = (index * batch_size) % max(1, len(examples) - batch_size + 1)
        batch = examples[start : start + batch_size]
        began = time.perf_counter()
        predictor.predict_examples(batch)
        times_ms.append((time.perf_counter() - began) * 1e3)
    return {f"latency_p50_ms_batch{batch_size}": float(np.percentile(times_ms, 50)),
            f"latency_p99_ms_batch{batch_size}": float(np.percentile(times_ms, 99))}


def run(config: PredictorBenchConfig, json_path: Path | None = None) -> dict:
    """Score every predictor on the held-out prompts; print the table and write JSON."""
    if config.split == "source" and config.artifact is not None:
        raise ValueError("--split source cannot score --artifact: the artifact was trained without that split, so "
                         "the held-out sources may be in its training data")
    rows = read_labels(config.label_paths)
    dataset = build_dataset(rows, load_prompt_texts_by_id(config.prompt_paths))
    train, held_out = split_dataset(dataset, config)
    sampled = has_samples(held_out)  # several temperatures or samples: also score per temperature
    print(f"{len(rows)} label rows: {len(dataset.examples)} joined to prompts "
          f"({len(dataset.missing_prompt_ids)} without a prompt), {len(train.examples)} train, "
          f"{len(held_out.examples)} held out")

    kinds = config.kinds if config.kinds is not None else (DEFAULT_KINDS if config.artifact is None else BASELINES)
    unknown = [kind for kind in kinds if kind not in KINDS]
    if unknown:
        raise ValueError(f"unknown predictor kinds {unknown}; choose from {', '.join(KINDS)}")
    predictors: dict[str, FittedLengthPredictor] = {
        kind: make_predictor(kind, config.quantile, config.max_len, FeatureConfig(use_embedding=config.use_embedding))
        for kind in kinds
    }
    artifact_version = None if config.artifact is None else read_manifest(config.artifact)["version"]

    results: dict[str, dict] = {}
    prefill_points: dict[str, dict[str, int]] = {}
    with tqdm(total=len(predictors) + (config.artifact is not None), desc="predictors", unit="model") as progress:
        for name, predictor in predictors.items():
            progress.set_postfix_str(f"fit {name}")
            predictor.fit(train.examples, train.lengths)
            progress.update()
        if config.artifact is not None:
            progress.set_postfix_str("load artifact")
            predictors["artifact"] = load_predictor(config.artifact)
            progress.update()
    for name, predictor in tqdm(predictors.items(), desc="scoring", unit="model"):
        began = time.perf_counter()
        predictions = predictor.predict_examples(held_out.examples)
        metrics = evaluate(predictions, held_out.lengths, config.max_len)
        metrics["predict_all_held_out_s"] = time.perf_counter() - began
        metrics["calibration"] = None if predictor.calibration is None else predictor.calibration.to_dict()
        raw = copy.copy(predictor)  # shares the fitted model; only the bound's calibration is dropped
        raw.calibration = None
        raw_metrics = evaluate(raw.predict_examples(held_out.examples), held_out.lengths, config.max_len)
        metrics["raw_under_reservation_rate"] = raw_metrics["under_reservation_rate"]
        metrics["raw_mean_over_reservation_tokens"] = raw_metrics["mean_over_reservation_tokens"]
        for batch_size in LATENCY_BATCH_SIZES:
            metrics.update(_latency_ms(predictor, held_out.examples, batch_size, config.num_latency_batches))
        if sampled:
            metrics["by_temperature"] = scores_by_temperature(predictions, held_out, config.max_len)
        results[name] = metrics
        # The probe features are greedy runs: the re-prediction table compares greedy rows only.
        prefill_points[name] = {example.prompt_id: prediction.point_tokens
                                for example, prediction in zip(held_out.examples, predictions)
                                if example.temperature == 0.0}
    probe_sizes = None
    if config.probe_features:
        print(f"hidden-state probes: training on the train side of {', '.join(map(str, config.probe_features))}",
              flush=True)
        features = load_features(config.probe_features)
        check_features_match(features, dataset, config.max_len)
        for name, points in prefill_points.items():
            results[name].update(probe_bench.text_predictor_remaining(points, features, config.is_held_out))
        probe_scores = probe_bench.score_probes(features, config.is_held_out, config.max_len, config.quantile,
                                                config.num_latency_batches)
        results.update(probe_scores.results)
        probe_sizes = probe_scores.sizes
        if sampled:
            for name, by_prompt in probe_scores.prefill_predictions.items():
                results[name]["by_temperature"] = prefill_scores_by_temperature(by_prompt, held_out, config.max_len)

    headers = ["predictor", "tau", "bucket_acc", "mae_tok", "under_rate", "over_res_tok", "raw_under", "raw_over",
               "p50_ms_b1", "p99_ms_b1", "p50_ms_b32", "p99_ms_b32"]
    table_rows = [[name, *(m[key] for key in METRICS), m["raw_under_reservation_rate"],
                   m["raw_mean_over_reservation_tokens"], m["latency_p50_ms_batch1"], m["latency_p99_ms_batch1"],
                   m["latency_p50_ms_batch32"], m["latency_p99_ms_batch32"]] for name, m in results.items()]
    print(format_table(headers, table_rows))
    if sampled:
        print("by sampling temperature; the distribution scores compare each prompt's prediction with all its samples "
              "(tau and MAE against the prompt's median sample, mean negative log-likelihood of the samples' buckets); the "
              "probes read greedy states and were trained on greedy rows, whatever the temperature")
        print(format_table(
            ["predictor", "temp", "prompts", "answers", "tau", "bucket_acc", "under_rate", "tau_median",
             "median_mae", "bucket_nll"],
            [[name, temperature, s["num_prompts"], s["num_examples"], s["kendall_tau"], s["bucket_accuracy"],
              s["under_reservation_rate"], s["kendall_tau_vs_median"], s["median_mae_tokens"], s["bucket_nll"]]
             for name, m in results.items() for temperature, s in m.get("by_temperature", {}).items()]))
    if config.probe_features:
        print("remaining tokens after decoding (MAE, and Kendall tau against the true remaining tokens of the answers "
              "still going): re-predicted where the predictor can, else prefill point minus decoded")
        print(format_table(
            ["predictor", *(f"mae_at_{n}" for n in probe_bench.REPREDICTION_POINTS),
             *(f"prefill_only_at_{n}" for n in probe_bench.REPREDICTION_POINTS),
             *(f"tau_at_{n}" for n in probe_bench.RANKING_POINTS)],
            [[name, *(m.get(f"remaining_mae_tokens_at_{n}") for n in probe_bench.REPREDICTION_POINTS),
              *(m.get(f"prefill_remaining_mae_tokens_at_{n}") for n in probe_bench.REPREDICTION_POINTS),
              *(m.get(f"remaining_tau_at_{n}") for n in probe_bench.RANKING_POINTS)]
             for name, m in results.items()]))
    result = {
        "config": {key: (str(value) if isinstance(value, Path) else value) for key, value in asdict(config).items()
                   if key not in ("label_paths", "prompt_paths", "artifact", "kinds", "held_out_sources",
                                  "probe_features")}
        | {"kinds": list(kinds), "probe_features": [str(path) for path in config.probe_features]}
        | {"label_paths": [str(p) for p in config.label_paths], "prompt_paths": [str(p) for p in config.prompt_paths],
           "artifact": None if config.artifact is None else str(config.artifact), "artifact_version": artifact_version},
        "dataset": {"num_label_rows": len(rows), "num_joined": len(dataset.examples),
                    "num_missing_prompt": len(dataset.missing_prompt_ids), "num_train": len(train.examples),
                    "num_held_out": len(held_out.examples), "split": config.split,
                    "held_out_sources": list(config.held_out_sources) if config.split == "source" else None,
                    "probe": probe_sizes},
        "environment": environment(),
        "predictors": results,
    }
    write_json(json_path, result)
    return result
