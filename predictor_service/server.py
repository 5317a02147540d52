"""The predictor as served: the active artifact version, hot-reloaded when a new one is promoted.

Plain Python (no Ray): `predictor_service.deployment` wraps it in a Ray Serve
deployment. Until a version exists under the artifact root (or with no root), it
serves the default artifact shipped in `predictor_service/default_artifact/`
(LightGBM over hashed n-grams, fitted on the shipped greedy and sampled labels); if that cannot be
loaded, the prompt-length baseline fitted on those labels. Both learnt SmolLM2's lengths: for another
model it serves the model-independent prior (`MaxTokensPrior`: the bound is max_tokens) until
retraining promotes a version learnt from that model's own answers. It logs which.
"""

import logging
from pathlib import Path

from predictor_service.artifacts import load_predictor, read_manifest, resolve_version_dir, trained_for
from predictor_service.baselines import MaxTokensPrior
from predictor_service.length_example import FittedLengthPredictor, LengthExample
from predictor_service.length_predictor import DEFAULT_MAX_LEN, DEFAULT_QUANTILE
from predictor_service.training import make_predictor, read_labels

logger = logging.getLogger(__name__)

SHIPPED_LABELS = Path(__file__).parent / "labels" / "smollm2-135m-instruct.pool.greedy.jsonl"
#: 4 answers at temperature 1.0 (the OpenAI API's default) for 319 of the greedy labels' prompts
SHIPPED_SAMPLED_LABELS = SHIPPED_LABELS.with_name("smollm2-135m-instruct.pool.sampled-t1.jsonl")
#: What the default artifact was fitted on
SHIPPED_LABEL_FILES = (SHIPPED_LABELS, SHIPPED_SAMPLED_LABELS)
DEFAULT_ARTIFACT_ROOT = Path(__file__).parent / "default_artifact"
BASELINE_VERSION = "baseline:prompt-length"
PRIOR_VERSION = "prior:max-tokens"
DEFAULT_VERSION_PREFIX = "default:"


def fit_prompt_length_baseline(labels_path: Path, quantile: float, max_len: int) -> FittedLengthPredictor:
    """The linear prompt-length baseline, fitted on a labels file (it needs no prompt text)."""
    rows = read_labels([labels_path])
    examples = [LengthExample(r.prompt_id, "", r.num_prompt_tokens, r.max_tokens, r.temperature) for r in rows]
    return make_predictor("linear", quantile, max_len).fit(examples, [r.num_output_tokens for r in rows])


def latest_version_dir(artifact_root: Path | None) -> Path | None:
    """The version LATEST names under `artifact_root`; None while there is none (the server serves the default)."""
    if artifact_root is None or not (artifact_root / "LATEST").is_file():
        return None
    return resolve_version_dir(artifact_root)


class LengthPredictorServer:
    """Answers prediction payloads with the active predictor version.

    `version` names what is served: an artifact's version, "default:<version>" for the
    shipped default artifact, or BASELINE_VERSION.

    Args:
        artifact_root: directory of versions with a LATEST pointer, or None.
        quantile: upper-bound coverage of the baseline used without any artifact.
        max_len: bucket range of that baseline.
        labels_path: labels the baseline is fitted on.
        default_root: artifact served until `artifact_root` has a version; None skips it.
        model: the served model; when the default artifact (and the shipped labels) are of another model, the
            `MaxTokensPrior` is served until `artifact_root` has a version. None: whatever the default learnt.
    """

    def __init__(self, artifact_root: str | Path | None, quantile: float = DEFAULT_QUANTILE, max_len: int = DEFAULT_MAX_LEN,
                 labels_path: Path = SHIPPED_LABELS, default_root: Path | None = DEFAULT_ARTIFACT_ROOT,
                 model: str | None = None) -> None:
        self.model = model
        self.artifact_root = Path(artifact_root) if artifact_root is not None else None
        self.quantile = quantile
        self.max_len = max_len
        self.labels_path = labels_path
        self.default_root = default_root
        self.version = None
        self.predictor: FittedLengthPredictor | None = None
        self.reload_if_promoted()

    def reload_if_promoted(self) -> bool:
        """Switch to the version LATEST names if it changed; True when it switched."""
        version_dir = latest_version_dir(self.artifact_root)
        if version_dir is None:
            if self.predictor is None:
                self._start_without_artifact()
                return True
            return False
        version = read_manifest(version_dir)["version"]
        if version == self.version:
            return False
        self.predictor = load_predictor(version_dir)
        self.version = version
        logger.info("serving predictor version %s", version)
        return True

    def _start_without_artifact(self) -> None:
        """The shipped default artifact, else the prompt-length baseline; for another model the prior. Logged."""
        if self.default_root is not None and self.model is not None and self._default_is_for_another_model():
            self.predictor = MaxTokensPrior(self.max_len)
            self.version = PRIOR_VERSION
            logger.warning("no predictor artifact under %s, and the shipped one learnt another model's lengths than "
                           "%s's: serving the prior (bound = max_tokens) until retraining promotes a version",
                           self.artifact_root, self.model)
            return
        if self.default_root is not None:
            try:
                self.predictor = load_predictor(self.default_root)
                self.version = DEFAULT_VERSION_PREFIX + read_manifest(self.default_root)["version"]
                logger.warning("no predictor artifact under %s: serving the shipped default artifact %s (%s)",
                               self.artifact_root, self.default_root, self.version)
                return
            except (ValueError, FileNotFoundError, ImportError) as error:
                logger.warning("the shipped default artifact %s does not load (%s)", self.default_root, error)
        self.predictor = fit_prompt_length_baseline(self.labels_path, self.quantile, self.max_len)
        self.version = BASELINE_VERSION
        logger.warning("no predictor artifact under %s: serving the prompt-length baseline fitted on %s",
                       self.artifact_root, self.labels_path)

    def _default_is_for_another_model(self) -> bool:
        try:
            learnt = trained_for(self.default_root)
        except (ValueError, FileNotFoundError):
            return False  # it does not load either; the baseline below says so
        return learnt is not None and learnt != self.model

    def predict(self, payloads: list[dict]) -> list[dict]:
        """Payloads {"prompt_id", "prompt_text", "num_prompt_tokens", "max_tokens", "temperature"?} -> predictions."""
        examples = [
            LengthExample(str(p.get("prompt_id", "")), str(p.get("prompt_text", "")), int(p["num_prompt_tokens"]),
                          int(p["max_tokens"]), float(p.get("temperature", 0.0)))
            for p in payloads
        ]
        return [
            {"point_tokens": int(pred.point_tokens), "upper_bound_tokens": int(pred.upper_bound_tokens),
             "bucket_probs": [float(x) for x in pred.bucket_probs], "version": self.version}
            for pred in self.predictor.predict_examples(examples)
        ]
