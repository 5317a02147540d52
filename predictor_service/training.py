"""From labels to a saved predictor: join, split, fit, score, save.

Labels are the JSONL rows `s3serve label` writes (no prompt text); the caller joins
them to prompt text by prompt id (`prompt_texts`), so this module reads no prompt files.
"""

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from predictor_service.artifacts import KINDS, save_predictor
from predictor_service.baselines import MeanLengthPredictor, PromptLengthLinearPredictor
from predictor_service.features import FeatureConfig
from predictor_service.kinds import CAPPED_LIGHTGBM
from predictor_service.length_example import FittedLengthPredictor, LengthExample
from predictor_service.length_predictor import DEFAULT_MAX_LEN, DEFAULT_QUANTILE
from predictor_service.lightgbm_predictor import BoosterConfig, LightGBMLengthPredictor
from predictor_service.transformer_predictor import TransformerConfig, TransformerLengthPredictor
from predictor_service.metrics import evaluate


@dataclass(frozen=True, slots=True)
class LabelRow:
    """One labelled generation (the fields of a `s3serve label` row we train on)."""

    prompt_id: str
    num_prompt_tokens: int
    num_output_tokens: int
    max_tokens: int
    temperature: float
    top_p: float = 1.0
    model: str | None = None  # the model whose answer it is (rows of `s3serve label` name it)


@dataclass(slots=True)
class LengthDataset:
    """Examples joined to their true output lengths.

    Attributes:
        examples: one per label row whose prompt was found.
        lengths: true output lengths in tokens, aligned with `examples`.
        missing_prompt_ids: ids of label rows whose prompt text was not given (not in `examples`).
    """

    examples: list[LengthExample]
    lengths: list[int]
    missing_prompt_ids: list[str] = field(default_factory=list)


def labelled_model(rows: Sequence[LabelRow]) -> str | None:
    """The one model whose answers `rows` are, or None when they name none or several."""
    models = {row.model for row in rows if row.model is not None}
    return models.pop() if len(models) == 1 else None


def read_labels(paths: Sequence[Path | str]) -> list[LabelRow]:
    """Every row of the labels JSONL files, in file order."""
    rows = []
    for path in map(Path, paths):
        if not path.is_file():
            raise FileNotFoundError(f"labels file {path} does not exist")
        with path.open(encoding="utf-8") as lines:
            for line_no, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    rows.append(LabelRow(
                        prompt_id=str(row["prompt_id"]), num_prompt_tokens=int(row["prompt_tokens"]),
                        num_output_tokens=int(row["output_tokens"]), max_tokens=int(row["sampling"]["max_tokens"]),
                        temperature=float(row["sampling"].get("temperature", 0.0)),
                        top_p=float(row["sampling"].get("top_p", 1.0)), model=row.get("model"),
                    ))
                except json.JSONDecodeError as error:
                    # A labelling run being appended to may end in a half-written line.
                    if line.endswith("\n"):
                        raise ValueError(f"{path}:{line_no}: not JSON ({error.msg})") from None
                except (KeyError, TypeError, ValueError) as error:
                    raise ValueError(f"{path}:{line_no}: not a label row ({error!r})") from None
    return rows


def build_dataset(rows: Sequence[LabelRow], prompt_texts: Mapping[str, str]) -> LengthDataset:
    """Join label rows to prompt text by prompt id; rows without text are reported, not kept."""
    dataset = LengthDataset([], [])
    for row in rows:
        text = prompt_texts.get(row.prompt_id)
        if text is None:
            dataset.missing_prompt_ids.append(row.prompt_id)
            continue
        dataset.examples.append(LengthExample(row.prompt_id, text, row.num_prompt_tokens, row.max_tokens,
                                              row.temperature))
        dataset.lengths.append(row.num_output_tokens)
    if not dataset.examples:
        sample = ", ".join(sorted(set(dataset.missing_prompt_ids))[:3])
        raise ValueError(f"none of the {len(rows)} label rows matches a prompt (label ids look like {sample}; "
                         "pass the prompt files the labels were made from)")
    return dataset


def is_held_out(prompt_id: str, held_out_fraction: float) -> bool:
    """Whether a prompt belongs to the held-out side: a hash of its id, the same in every run."""
    digest = hashlib.sha256(prompt_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < held_out_fraction


def split_by(dataset: LengthDataset, held_out: Callable[[str], bool]) -> tuple[LengthDataset, LengthDataset]:
    """(train, held_out) by a predicate on the prompt id; every sample of one prompt lands on the same side."""
    train, held = LengthDataset([], []), LengthDataset([], [])
    for example, length in zip(dataset.examples, dataset.lengths):
        side = held if held_out(example.prompt_id) else train
        side.examples.append(example)
        side.lengths.append(length)
    return train, held


def split_by_prompt_id(dataset: LengthDataset, held_out_fraction: float = 0.2) -> tuple[LengthDataset, LengthDataset]:
    """(train, held_out); every sample of one prompt lands on the same side."""
    if not 0.0 < held_out_fraction < 1.0:
        raise ValueError(f"held_out_fraction must be in (0, 1), got {held_out_fraction}")
    train, held_out = split_by(dataset, lambda prompt_id: is_held_out(prompt_id, held_out_fraction))
    if not train.examples or not held_out.examples:
        raise ValueError(f"{len(dataset.examples)} examples are too few to split at held_out_fraction="
                         f"{held_out_fraction} ({len(train.examples)} train, {len(held_out.examples)} held out)")
    return train, held_out


def make_predictor(kind: str, quantile: float = DEFAULT_QUANTILE, max_len: int = DEFAULT_MAX_LEN,
                   feature_config: FeatureConfig | None = None,
                   transformer_config: TransformerConfig | None = None,
                   booster_config: BoosterConfig | None = None) -> FittedLengthPredictor:
    """An unfitted predictor of `kind` ("lightgbm", "lightgbm_capped": its cap-aware point, "transformer", "mean"
    or "linear"); `booster_config` sets LightGBM's boosters."""
    if kind == "transformer":
        return TransformerLengthPredictor(quantile, max_len, transformer_config)
    if kind == "mean":
        return MeanLengthPredictor(quantile, max_len)
    if kind == "linear":
        return PromptLengthLinearPredictor(quantile, max_len)
    if kind == "lightgbm":
        return LightGBMLengthPredictor(feature_config or FeatureConfig(), quantile, max_len, booster_config)
    if kind == CAPPED_LIGHTGBM:
        return LightGBMLengthPredictor(feature_config or FeatureConfig(), quantile, max_len, booster_config,
                                       cap_aware=True)
    raise ValueError(f"unknown predictor kind {kind!r}; choose one of lightgbm, {CAPPED_LIGHTGBM}, transformer, mean, "
                     "linear")


@dataclass(frozen=True, slots=True)
class TrainResult:
    """What a training run produced.

    Attributes:
        predictor: the fitted predictor.
        metrics: held-out metrics (see metrics.evaluate).
        artifact_dir: the version directory written, None when not saved.
        num_train: training examples.
        num_held_out: held-out examples.
    """

    predictor: FittedLengthPredictor
    metrics: dict
    artifact_dir: Path | None
    num_train: int
    num_held_out: int


def train_predictor(dataset: LengthDataset, kind: str, max_len: int = DEFAULT_MAX_LEN, quantile: float = DEFAULT_QUANTILE,
                    feature_config: FeatureConfig | None = None, held_out_fraction: float = 0.2,
                    out_dir: Path | str | None = None,
                    transformer_config: TransformerConfig | None = None, fit_all: bool = False,
                    model: str | None = None) -> TrainResult:
    """Split, fit `kind` on the train side, score it on the held-out side, and save it under `out_dir`, recording
    `model`, the model whose lengths the labels are, when given.

    With `fit_all`, the saved predictor is then refitted on every example (the shipped
    default artifact is made so); its metrics are those of the train-side fit on unseen prompts.
    """
    predictor = make_predictor(kind, quantile, max_len, feature_config, transformer_config)
    train, held_out = split_by_prompt_id(dataset, held_out_fraction)
    predictor.fit(train.examples, train.lengths)
    metrics = evaluate(predictor.predict_examples(held_out.examples), held_out.lengths, max_len)
    if fit_all:
        predictor = make_predictor(kind, quantile, max_len, feature_config, transformer_config)
        predictor.fit(dataset.examples, dataset.lengths)
    artifact_dir = None
    if out_dir is not None:
        calibration = {"quantile": quantile, "held_out_coverage": 1.0 - metrics["under_reservation_rate"],
                       "num_held_out": len(held_out.examples),
                       "fitted_on": "all labels" if fit_all else "train split"}
        artifact_dir = save_predictor(predictor, out_dir, metrics, calibration, model)
    return TrainResult(predictor, metrics, artifact_dir, len(train.examples), len(held_out.examples))
