"""Online retraining: new versions from the service's own finished requests, promoted only when better.

The decisions (`should_retrain`, `is_better`) are pure; `Retrainer` reads the
Redis sample stream, chooses the candidate's kind as `s3serve calibrate` does (the
highest leave-one-source-out tau, `predictor_service.recipe`; the service's requests name
no source, so their prompts are clustered), fits it on everything but the most recent
window, scores candidate and active predictor on that window (the traffic the next
version will face), and writes a new artifact version only if the candidate wins there
and its kind ranks unseen sources no worse than the active version's kind, both refitted
on the same samples.
"""

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from predictor_service.artifacts import load_predictor, save_predictor
from predictor_service.features import FeatureConfig
from predictor_service.length_example import FittedLengthPredictor
from predictor_service.length_predictor import DEFAULT_MAX_LEN, DEFAULT_QUANTILE
from predictor_service.metrics import evaluate
from predictor_service.kinds import CANDIDATE_KINDS, REFITTABLE_KINDS
from predictor_service.recipe import (MIN_SOURCE_PROMPTS, RecipeScore, choose_recipe, holdout_sources, kind_of,
                                      leave_source_out_tau)
from predictor_service.sample_stream import SampleStream, TrainingSample
from predictor_service.training import make_predictor


BASELINE_KIND = "linear"  # what a candidate must beat before any version is promoted: prompt length alone


@dataclass(frozen=True, slots=True)
class RetrainConfig:
    """When and how to retrain.

    Attributes:
        min_new_samples: retrain once this many samples arrived since the last attempt...
        max_interval_s: ...or this long passed with at least one new sample.
        window_fraction: most recent share of samples held out to compare versions.
        min_window: fewest held-out samples a comparison may rest on.
        kinds: the candidate kinds ("lightgbm", "lightgbm_capped", "linear", "mean"); the one with the highest
            leave-source-out tau is fitted.
        quantile: upper-bound coverage.
        max_len: bucket range.
        max_under_reservation_increase: a candidate may not raise the
            under-reservation rate by more than this, however much it lowers MAE.
        use_embedding: include the MiniLM embedding in LightGBM features.
        model: the served model, whose lengths the samples are (recorded in each version it saves).
        min_source_prompts: fewest prompts of a source (a cluster of the samples' prompts) that it is held out.
        max_source_samples: the leave-source-out scores use at most this many of the latest samples (each kind is
            fitted once per source).
    """

    min_new_samples: int = 200
    max_interval_s: float = 3600.0
    window_fraction: float = 0.2
    min_window: int = 20
    kinds: tuple[str, ...] = CANDIDATE_KINDS
    quantile: float = DEFAULT_QUANTILE
    max_len: int = DEFAULT_MAX_LEN
    max_under_reservation_increase: float = 0.02
    use_embedding: bool = False
    model: str | None = None
    min_source_prompts: int = MIN_SOURCE_PROMPTS
    max_source_samples: int = 4000

    def __post_init__(self) -> None:
        unknown = [kind for kind in self.kinds if kind not in REFITTABLE_KINDS]
        if not self.kinds or unknown:
            raise ValueError(f"kinds must be some of {', '.join(REFITTABLE_KINDS)}, got {list(self.kinds)}")
        if not 0.0 < self.window_fraction < 1.0:
            raise ValueError(f"window_fraction must be in (0, 1), got {self.window_fraction}")
        if min(self.min_new_samples, self.min_window, self.min_source_prompts, self.max_source_samples) < 1:
            raise ValueError(f"min_new_samples, min_window, min_source_prompts and max_source_samples must be >= 1, "
                             f"got {self.min_new_samples}, {self.min_window}, {self.min_source_prompts}, "
                             f"{self.max_source_samples}")


def should_retrain(num_new_samples: int, seconds_since_last: float, config: RetrainConfig) -> bool:
    """Enough new samples, or a stale model with something new to learn from."""
    if num_new_samples >= config.min_new_samples:
        return True
    return num_new_samples > 0 and seconds_since_last >= config.max_interval_s


def is_better(candidate: dict, active: dict, config: RetrainConfig) -> bool:
    """Lower MAE without giving up more than the allowed under-reservation (which causes preemptions), and a kind that
    ranks unseen sources no worse (`source_tau`, where both have one)."""
    if candidate["under_reservation_rate"] > active["under_reservation_rate"] + config.max_under_reservation_increase:
        return False
    if candidate.get("source_tau") is not None and active.get("source_tau") is not None \
            and candidate["source_tau"] < active["source_tau"]:
        return False
    return candidate["mae_tokens"] < active["mae_tokens"]


@dataclass(frozen=True, slots=True)
class RetrainOutcome:
    """One retraining attempt, for logs and metrics export."""

    promoted: bool
    reason: str
    version_dir: Path | None
    candidate_metrics: dict | None
    active_metrics: dict | None
    num_train: int
    num_window: int


class Retrainer:
    """Retrains from the sample stream into a versioned artifact root.

    Args:
        stream: the Redis sample stream.
        artifact_root: where versions live (LATEST is the active one).
        config: when and how.
        clock: seconds, monotonic; injectable for tests.
    """

    def __init__(self, stream: SampleStream, artifact_root: Path | str, config: RetrainConfig,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stream = stream
        self.artifact_root = Path(artifact_root)
        self.config = config
        self.clock = clock
        self.last_seen_id = "0-0"
        self.last_attempt_s = clock()

    def maybe_retrain(self) -> RetrainOutcome | None:
        """Retrain if `should_retrain` says so; None when it is not time yet."""
        new = self.stream.read(self.last_seen_id)
        if not should_retrain(len(new), self.clock() - self.last_attempt_s, self.config):
            return None
        if new:
            self.last_seen_id = new[-1][0]
        self.last_attempt_s = self.clock()
        return self.retrain([sample for _, sample in self.stream.read()])

    def retrain(self, samples: list[TrainingSample]) -> RetrainOutcome:
        """Fit a candidate on all but the latest window; promote it if it beats the active version there."""
        num_window = max(self.config.min_window, int(len(samples) * self.config.window_fraction))
        if len(samples) < num_window + self.config.min_window:
            return RetrainOutcome(False, f"only {len(samples)} samples; need {num_window + self.config.min_window}",
                                  None, None, None, 0, 0)
        train, window = samples[:-num_window], samples[-num_window:]
        window_examples = [s.example() for s in window]
        window_lengths = [s.true_output_tokens for s in window]
        active = self._active_or_baseline(train)
        recipe, active_recipe = self._recipes(train[-self.config.max_source_samples:], kind_of(active))
        candidate = make_predictor(recipe.kind, self.config.quantile, self.config.max_len, self._features())
        candidate.fit([s.example() for s in train], [s.true_output_tokens for s in train])
        candidate_metrics = evaluate(candidate.predict_examples(window_examples), window_lengths,
                                     self.config.max_len) | recipe.to_dict()
        active_metrics = evaluate(active.predict_examples(window_examples), window_lengths,
                                  self.config.max_len) | active_recipe.to_dict()
        if not is_better(candidate_metrics, active_metrics, self.config):
            return RetrainOutcome(False, "candidate is not better on the recent window and on unseen sources", None,
                                  candidate_metrics, active_metrics, len(train), len(window))
        calibration = {"quantile": self.config.quantile,
                       "window_coverage": 1.0 - candidate_metrics["under_reservation_rate"],
                       "num_window": len(window)}
        version_dir = save_predictor(candidate, self.artifact_root, candidate_metrics, calibration,
                                     self.config.model)
        return RetrainOutcome(True, "candidate beat the active version on the recent window", version_dir,
                              candidate_metrics, active_metrics, len(train), len(window))

    def run(self, stop: threading.Event, poll_s: float = 30.0,
            on_outcome: Callable[[RetrainOutcome], None] | None = None) -> None:
        """The retraining task: check every `poll_s` seconds until `stop` is set."""
        while not stop.is_set():
            outcome = self.maybe_retrain()
            if outcome is not None and on_outcome is not None:
                on_outcome(outcome)
            stop.wait(poll_s)

    def _features(self) -> FeatureConfig:
        return FeatureConfig(use_embedding=self.config.use_embedding)

    def _recipes(self, samples: list[TrainingSample], active_kind: str) -> tuple[RecipeScore, RecipeScore]:
        """(the candidate kind chosen by leave-source-out tau on the training samples, the active version's kind
        scored the same way on the same samples; no score for a kind that cannot be refitted in seconds)."""
        examples = [s.example() for s in samples]
        lengths = [s.true_output_tokens for s in samples]
        sources = holdout_sources(examples, None, self.config.min_source_prompts, self._features().num_hash_dims)
        best, scores = choose_recipe(self.config.kinds, examples, lengths, sources, self.config.quantile,
                                     self.config.max_len, self._features(), self.config.min_source_prompts)
        if active_kind in scores:
            return best, scores[active_kind]
        if active_kind not in REFITTABLE_KINDS:
            return best, RecipeScore(active_kind, None, {}, f"{active_kind} is not refitted per source")
        return best, leave_source_out_tau(active_kind, examples, lengths, sources, self.config.quantile,
                                          self.config.max_len, self._features(), self.config.min_source_prompts)

    def _active_or_baseline(self, train: list[TrainingSample]) -> FittedLengthPredictor:
        """The promoted version, or with none yet the prompt-length baseline fitted on the same data."""
        if (self.artifact_root / "LATEST").is_file():
            return load_predictor(self.artifact_root)
        baseline = make_predictor(BASELINE_KIND, self.config.quantile, self.config.max_len)
        return baseline.fit([s.example() for s in train], [s.true_output_tokens for s in train])


RETRAIN_EXPORT_KEY = "s3:predictor:retrain:last"


def export_outcome(client, outcome: RetrainOutcome, key: str = RETRAIN_EXPORT_KEY) -> None:
    """Publish the latest attempt to Redis (hash `key`) for the service's metrics endpoint."""
    client.hset(key, mapping={
        "promoted": int(outcome.promoted),
        "reason": outcome.reason,
        "version_dir": "" if outcome.version_dir is None else str(outcome.version_dir),
        "candidate_metrics": json.dumps(outcome.candidate_metrics),
        "active_metrics": json.dumps(outcome.active_metrics),
        "num_train": outcome.num_train,
        "num_window": outcome.num_window,
        "at_unix_s": time.time(),
    })
