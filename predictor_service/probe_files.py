"""Where a trained hidden-state probe lives on disk: a folder with a manifest and the weights.

Pure (no torch): the service's config checks a probe folder in the controller's process,
which never loads a model; `predictor_service.hidden_probe` reads and writes the files.
"""

from pathlib import Path

PROBE_MANIFEST_FILE = "probe.json"  # what `s3serve probe train` writes: the manifest and the weights
PROBE_WEIGHTS_FILE = "probe.pt"


def is_probe_folder(folder: Path | str) -> bool:
    """Whether `folder` holds a trained probe."""
    return all((Path(folder) / name).is_file() for name in (PROBE_MANIFEST_FILE, PROBE_WEIGHTS_FILE))


def check_probe_folder(folder: Path | str, spec: str) -> None:
    """Raise ValueError, naming the `length_probe` setting `spec`, unless `folder` holds a trained probe."""
    if not is_probe_folder(folder):
        raise ValueError(f"length_probe {spec!r} is not a probe folder (needs {PROBE_MANIFEST_FILE} and "
                         f"{PROBE_WEIGHTS_FILE}): give 'default' or a folder from `s3serve probe train`")
