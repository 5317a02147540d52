"""Where a trained hidden-state probe lives on disk (a folder with a manifest and the weights), and the probe's
configuration, which its manifest holds.

Pure (no torch): the service's config checks a probe folder in the controller's process,
which never loads a model, and the CLI offers the configuration's defaults without loading torch;
`predictor_service.hidden_probe` reads and writes the files.
"""

from dataclasses import dataclass
from pathlib import Path

from predictor_service.length_predictor import DEFAULT_MAX_LEN, DEFAULT_QUANTILE

PROBE_MANIFEST_FILE = "probe.json"  # what `s3serve probe train` writes: the manifest and the weights
PROBE_WEIGHTS_FILE = "probe.pt"
DEFAULT_INTERVAL_TOKENS = 64  # decoded tokens between a probe's reads (the rows `probe extract` records)
DEFAULT_LAST_CHECKPOINT_TOKENS = 256  # the last decoded count `probe extract` records, so the furthest a probe reads


def is_probe_folder(folder: Path | str) -> bool:
    """Whether `folder` holds a trained probe."""
    return all((Path(folder) / name).is_file() for name in (PROBE_MANIFEST_FILE, PROBE_WEIGHTS_FILE))


def check_probe_folder(folder: Path | str, spec: str) -> None:
    """Raise ValueError, naming the `length_probe` setting `spec`, unless `folder` holds a trained probe."""
    if not is_probe_folder(folder):
        raise ValueError(f"length_probe {spec!r} is not a probe folder (needs {PROBE_MANIFEST_FILE} and "
                         f"{PROBE_WEIGHTS_FILE}): give 'default' or a folder from `s3serve probe train`")


@dataclass(frozen=True, slots=True)
class ProbeConfig:
    """How the probe is built and trained.

    Attributes:
        max_len: longest sequence; the buckets span [0, max_len].
        num_buckets: equal-width total-length buckets.
        quantile: coverage target of the upper bound.
        hidden_units: MLP width; 0 for a linear probe.
        ranking_weight: weight of the pairwise ranking loss (0: none).
        num_epochs, batch_size, learning_rate, weight_decay, dropout: training.
        interval_tokens: re-predict every this many decoded tokens in the worker.
        calibration_fraction: share of prompts (by id hash) kept for the conformal offset.
        seed: initialisation and batch order.
        cap_aware: add the cap head and point at the expected capped remainder (`predictor_service.hidden_probe`).
    """

    max_len: int = DEFAULT_MAX_LEN
    num_buckets: int = 10
    quantile: float = DEFAULT_QUANTILE
    hidden_units: int = 256
    ranking_weight: float = 0.0
    num_epochs: int = 40
    batch_size: int = 128
    learning_rate: float = 3e-3
    weight_decay: float = 1e-2
    dropout: float = 0.2
    interval_tokens: int = DEFAULT_INTERVAL_TOKENS
    calibration_fraction: float = 0.2
    seed: int = 0
    cap_aware: bool = False

    def __post_init__(self) -> None:
        if not 0.5 < self.quantile < 1.0:
            raise ValueError(f"quantile must be in (0.5, 1), got {self.quantile}")
        if self.hidden_units < 0 or self.num_buckets < 2 or self.interval_tokens < 1:
            raise ValueError("hidden_units must be >= 0, num_buckets >= 2 and interval_tokens >= 1")
