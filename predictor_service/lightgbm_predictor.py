"""LightGBM over cheap prompt features: three boosters behind one LengthPredictor.

    point:   L2 regression on log1p(length)               -> expm1 -> point_tokens
    upper:   quantile regression (alpha = quantile) on log1p(length) -> upper_bound_tokens
    buckets: multiclass over the 10 equal-width buckets    -> bucket_probs

With `cap_aware`, an answer that ran to its `max_tokens` is what it is, a censored
observation (it would have gone on), not a length. Two boosters take the point booster's place:

    cap:      binary, the chance p of running to the cap
    finished: L2 regression on log1p(length) of the answers that stopped on their own
    point  =  p * max_tokens + (1 - p) * min(max_tokens, expm1(finished))

so the point is the expected capped length, the work a scheduler ranks by, and a prompt
likely to hit the cap ranks above every one likely to stop short.

A quantile is unchanged by a monotone transform, so the quantile booster can work on
the log scale like the point booster (trees fit the long tail better there). Both
outputs are clamped to [1, max_tokens], and the bound to at least the point.

The quantile booster's coverage on its own training set says little about unseen
prompts, so `fit` first trains it K times, each time without one fold of prompts,
and calibrates the bound conformally on those out-of-fold predictions
(cross-conformal; see calibration.py) before fitting the final boosters on all.
"""

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from predictor_service.baselines import check_quantile
from predictor_service.calibration import fit_calibration, fold_of
from predictor_service.features import FeatureConfig, FeatureExtractor
from predictor_service.length_example import FittedLengthPredictor, LengthExample, check_training_set, clamp_tokens
from predictor_service.length_predictor import DEFAULT_MAX_LEN, DEFAULT_QUANTILE, LengthPrediction
from predictor_service.metrics import bucket_of

NUM_BUCKETS = 10
MODEL_FILES = {"point": "point.lgb.txt", "upper": "upper.lgb.txt", "buckets": "buckets.lgb.txt"}
CAP_MODEL_FILES = {"cap": "cap.lgb.txt", "finished": "finished.lgb.txt"}  # with cap_aware, in point's place


@dataclass(frozen=True, slots=True)
class BoosterConfig:
    """LightGBM training settings shared by the three boosters.

    Attributes:
        num_rounds: boosting rounds of the point and upper-bound regressors.
        num_bucket_rounds: rounds of the bucket classifier (each round grows 10 trees).
        learning_rate: shrinkage per round.
        num_leaves: leaves per tree.
        min_data_in_leaf: smallest leaf; small so that a few hundred labels can be fitted.
        num_threads: CPU threads; 1 keeps training deterministic and polite on small machines.
        seed: seed of every random choice LightGBM makes.
        num_calibration_folds: folds of the cross-conformal calibration of the bound; 0 keeps the raw bound.
    """

    num_rounds: int = 200
    num_bucket_rounds: int = 60
    learning_rate: float = 0.05
    num_leaves: int = 15
    min_data_in_leaf: int = 5
    num_threads: int = 1
    seed: int = 0
    num_calibration_folds: int = 5

    def __post_init__(self) -> None:
        for name in ("num_rounds", "num_bucket_rounds", "num_leaves", "min_data_in_leaf", "num_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_calibration_folds == 1 or self.num_calibration_folds < 0:
            raise ValueError(f"num_calibration_folds must be 0 (off) or >= 2, got {self.num_calibration_folds}")
        if not 0.0 < self.learning_rate <= 1.0:
            raise ValueError(f"learning_rate must be in (0, 1], got {self.learning_rate}")

    def lightgbm_params(self) -> dict:
        return {"learning_rate": self.learning_rate, "num_leaves": self.num_leaves,
                "min_data_in_leaf": self.min_data_in_leaf, "num_threads": self.num_threads, "seed": self.seed,
                "deterministic": True, "force_row_wise": True, "verbose": -1}


class LightGBMLengthPredictor(FittedLengthPredictor):
    """Point estimate, upper bound and bucket probabilities from LightGBM boosters.

    Args:
        feature_config: which features to extract.
        quantile: probability that the true length stays within the upper bound.
        max_len: longest sequence; the buckets span [0, max_len].
        booster_config: LightGBM settings.
        cap_aware: point at the expected capped length from the cap and finished boosters (above).
    """

    name = "lightgbm"
    needs_text = True

    def __init__(self, feature_config: FeatureConfig | None = None, quantile: float = DEFAULT_QUANTILE, max_len: int = DEFAULT_MAX_LEN,
                 booster_config: BoosterConfig | None = None, cap_aware: bool = False) -> None:
        super().__init__()
        check_quantile(quantile)
        if max_len < NUM_BUCKETS:
            raise ValueError(f"max_len must be >= {NUM_BUCKETS}, got {max_len}")
        self.feature_config = feature_config or FeatureConfig()
        self.quantile = quantile
        self.max_len = max_len
        self.booster_config = booster_config or BoosterConfig()
        self.cap_aware = cap_aware
        self.features = FeatureExtractor(self.feature_config)
        self.boosters: dict = {}

    def fit(self, examples: Sequence[LengthExample], lengths: Sequence[int]) -> "LightGBMLengthPredictor":
        import lightgbm

        array = check_training_set(examples, lengths)
        matrix = self.features.transform(examples)  # [n, num_features]
        log_lengths = np.log1p(array)
        params = self.booster_config.lightgbm_params()
        rounds = self.booster_config.num_rounds
        self.calibration = self._cross_conformal(examples, matrix, array)
        self.boosters = {
            "upper": lightgbm.train({**params, "objective": "quantile", "alpha": self.quantile},
                                    lightgbm.Dataset(matrix, log_lengths), num_boost_round=rounds),
            "buckets": lightgbm.train({**params, "objective": "multiclass", "num_class": NUM_BUCKETS},
                                      lightgbm.Dataset(matrix, bucket_of(array, self.max_len, NUM_BUCKETS)),
                                      num_boost_round=self.booster_config.num_bucket_rounds),
        }
        if self.cap_aware:  # the point comes from the cap and finished boosters
            self.boosters |= self._cap_boosters(examples, matrix, array)
        else:
            self.boosters["point"] = lightgbm.train({**params, "objective": "regression"},
                                                    lightgbm.Dataset(matrix, log_lengths), num_boost_round=rounds)
        return self

    def _cap_boosters(self, examples: Sequence[LengthExample], matrix: np.ndarray, lengths: np.ndarray) -> dict:
        """The cap booster (did the answer run to its max_tokens?) and the finished booster (log length of those
        that did not); each needs both kinds of answer among the examples."""
        import lightgbm

        capped = lengths >= np.array([example.max_tokens for example in examples])  # [n]
        if capped.all() or not capped.any():
            raise ValueError(f"cap_aware needs answers that ran to their max_tokens and answers that stopped: "
                             f"{int(capped.sum())} of {len(capped)} ran to the cap")
        params = self.booster_config.lightgbm_params()
        rounds = self.booster_config.num_rounds
        return {
            "cap": lightgbm.train({**params, "objective": "binary"}, lightgbm.Dataset(matrix, capped.astype(float)),
                                  num_boost_round=rounds),
            "finished": lightgbm.train({**params, "objective": "regression"},
                                       lightgbm.Dataset(matrix[~capped], np.log1p(lengths[~capped])),
                                       num_boost_round=rounds),
        }

    def _cross_conformal(self, examples: Sequence[LengthExample], matrix: np.ndarray, lengths: np.ndarray):
        """Calibration from out-of-fold quantile-booster bounds; None when folds are off or too small."""
        import lightgbm

        num_folds = self.booster_config.num_calibration_folds
        if num_folds == 0:
            return None
        folds = np.array([fold_of(example.prompt_id, num_folds) for example in examples])
        if len(set(folds.tolist())) < 2:
            return None
        params = {**self.booster_config.lightgbm_params(), "objective": "quantile", "alpha": self.quantile}
        max_tokens = np.array([example.max_tokens for example in examples])
        raw_uppers = np.zeros(len(examples))
        for fold in np.unique(folds):
            held = folds == fold
            booster = lightgbm.train(params, lightgbm.Dataset(matrix[~held], np.log1p(lengths[~held])),
                                     num_boost_round=self.booster_config.num_rounds)
            raw_uppers[held] = np.expm1(booster.predict(matrix[held], num_threads=1))
        raw_uppers = clamp_tokens(raw_uppers, max_tokens)
        return fit_calibration(raw_uppers, lengths, self.quantile, f"cross-conformal-{num_folds}")

    def predict_examples(self, examples: Sequence[LengthExample]) -> list[LengthPrediction]:
        if not self.boosters:
            raise ValueError("LightGBMLengthPredictor is not fitted: call fit() or load an artifact")
        if not examples:
            return []
        matrix = self.features.transform(examples)  # [n, num_features]
        max_tokens = np.array([example.max_tokens for example in examples])
        # One thread: OpenMP start-up costs more than a small batch's trees (21 ms vs 0.2 ms at batch 1).
        raw = {role: np.asarray(booster.predict(matrix, num_threads=1)) for role, booster in self.boosters.items()}
        if self.cap_aware:
            finished = np.minimum(np.expm1(raw["finished"]), max_tokens)
            points = clamp_tokens(raw["cap"] * max_tokens + (1.0 - raw["cap"]) * finished, max_tokens)
        else:
            points = clamp_tokens(np.expm1(raw["point"]), max_tokens)
        uppers = np.maximum(self.calibrated_upper(np.expm1(raw["upper"]), max_tokens), points)
        probs = raw["buckets"].reshape(len(examples), NUM_BUCKETS)
        return [
            LengthPrediction(int(p), int(u), tuple(float(x) for x in row)) for p, u, row in zip(points, uppers, probs)
        ]

    def cap_probability(self, examples: Sequence[LengthExample]) -> np.ndarray:
        """[len(examples)] the chance each answer runs to its max_tokens (cap_aware only)."""
        if "cap" not in self.boosters:
            raise ValueError("cap_probability needs a cap_aware LightGBMLengthPredictor, fitted")
        return np.asarray(self.boosters["cap"].predict(self.features.transform(examples), num_threads=1))

    def to_params(self) -> dict:
        return {"quantile": self.quantile, "max_len": self.max_len, "booster_config": asdict(self.booster_config),
                "cap_aware": self.cap_aware}

    def _model_files(self) -> dict[str, str]:
        """Role -> file of every booster this predictor has: cap_aware ones point by the cap and finished boosters."""
        if not self.cap_aware:
            return MODEL_FILES
        return {role: name for role, name in MODEL_FILES.items() if role != "point"} | CAP_MODEL_FILES

    def save_models(self, directory: Path) -> list[str]:
        """Write the boosters as LightGBM text model files; returns the file names."""
        if not self.boosters:
            raise ValueError("LightGBMLengthPredictor is not fitted: nothing to save")
        for role, file_name in self._model_files().items():
            self.boosters[role].save_model(str(directory / file_name))
        return list(self._model_files().values())

    @classmethod
    def load(cls, params: dict, feature_config: FeatureConfig, directory: Path) -> "LightGBMLengthPredictor":
        """The predictor saved by `to_params` and `save_models` in `directory`."""
        import lightgbm

        predictor = cls(feature_config, params["quantile"], params["max_len"],
                        BoosterConfig(**params["booster_config"]), bool(params.get("cap_aware", False)))
        for role, file_name in predictor._model_files().items():
            path = directory / file_name
            try:
                booster = lightgbm.Booster(model_file=str(path))
            except lightgbm.basic.LightGBMError as error:
                raise ValueError(f"{path} is not a LightGBM model file: {error}") from None
            if booster.num_feature() != feature_config.num_features:
                raise ValueError(f"{path} expects {booster.num_feature()} features but the feature config "
                                 f"gives {feature_config.num_features}")
            predictor.boosters[role] = booster
        return predictor
