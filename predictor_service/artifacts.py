"""Versioned predictor artifacts on disk.

    ROOT/
      LATEST                 "v0002": the version `load_predictor(ROOT)` opens
      v0001/ ...
      v0002/
        manifest.json        format, kind, version string, creation time, file list, the model its labels are of
        params.json          the predictor's fitted numbers and settings
        features.json        FeatureConfig (lightgbm only)
        calibration.json     the quantile, the bound's measured coverage and its conformal offset ("conformal")
        metrics.json         held-out metrics at training time
        *.lgb.txt            LightGBM text model files (lightgbm only)
        transformer.safetensors  fine-tuned top layers and heads (transformer only; the rest is the wheel's)

A version directory is written once and never changed; a new training run writes
the next one and moves LATEST.
"""

import json
import re
import time
from pathlib import Path

from predictor_service.baselines import MeanLengthPredictor, PromptLengthLinearPredictor
from predictor_service.calibration import BoundCalibration
from predictor_service.features import FeatureConfig
from predictor_service.length_example import FittedLengthPredictor
from predictor_service.lightgbm_predictor import LightGBMLengthPredictor
from predictor_service.table_predictor import TableLengthPredictor
from predictor_service.transformer_predictor import TransformerLengthPredictor

FORMAT_VERSION = 1
KINDS = ("lightgbm", "transformer", "mean", "linear", "table")  # table: a benchmark instrument
_VERSION_DIR = re.compile(r"^v(\d{4,})$")


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise ValueError(f"artifact file {path} is missing")
    try:
        value = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"artifact file {path} is not valid JSON ({error.msg})") from None
    if not isinstance(value, dict):
        raise ValueError(f"artifact file {path} must hold a JSON object")
    return value


def _next_version_dir(root: Path) -> Path:
    numbers = [int(m.group(1)) for child in root.iterdir() if (m := _VERSION_DIR.match(child.name))]
    return root / f"v{max(numbers, default=0) + 1:04d}"


def save_predictor(predictor: FittedLengthPredictor, root: Path | str, metrics: dict, calibration: dict,
                   model: str | None = None) -> Path:
    """Write `predictor` as the next version under `root` and point LATEST at it.

    Args:
        predictor: a fitted mean, linear, LightGBM or transformer predictor.
        root: the artifact root (created if missing).
        metrics: held-out metrics to keep with the model.
        calibration: what is known of the upper bound's coverage.
        model: the model whose output lengths it learnt (recorded; the service warns when it serves another).

    Returns:
        The new version directory.
    """
    if predictor.name not in KINDS:
        raise ValueError(f"cannot save a predictor of kind {predictor.name!r}; known kinds: {', '.join(KINDS)}")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    directory = _next_version_dir(root)
    directory.mkdir()
    files = ["manifest.json", "params.json", "calibration.json", "metrics.json"]
    _write_json(directory / "params.json", predictor.to_params())
    if isinstance(predictor, LightGBMLengthPredictor):
        _write_json(directory / "features.json", predictor.feature_config.to_dict())
        files.append("features.json")
        files += predictor.save_models(directory)
    if isinstance(predictor, TransformerLengthPredictor):
        files += predictor.save_models(directory)
    if predictor.calibration is not None:
        calibration = {**calibration, "conformal": predictor.calibration.to_dict()}
    _write_json(directory / "calibration.json", calibration)
    _write_json(directory / "metrics.json", metrics)
    created_at = time.strftime("%Y%m%dT%H%M%S")
    _write_json(directory / "manifest.json", {
        "format_version": FORMAT_VERSION, "kind": predictor.name,
        "version": f"{predictor.name}-{directory.name}-{created_at}", "created_at": created_at, "files": files,
        **({} if model is None else {"model": model}),
    })
    (root / "LATEST").write_text(directory.name + "\n")
    return directory


def resolve_version_dir(path: Path | str) -> Path:
    """The version directory `path` names: itself if it has a manifest, else the one its LATEST names."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"predictor artifact {path} does not exist")
    if (path / "manifest.json").is_file():
        return path
    latest = path / "LATEST"
    if not latest.is_file():
        raise ValueError(f"{path} is not a predictor artifact: it has neither manifest.json nor LATEST")
    name = latest.read_text().strip()
    if not _VERSION_DIR.match(name) or not (path / name / "manifest.json").is_file():
        raise ValueError(f"{latest} names {name!r}, which is not a version directory with a manifest.json")
    return path / name


def read_manifest(path: Path | str) -> dict:
    """The manifest of the artifact at `path` (a version directory or a root), checked."""
    directory = resolve_version_dir(path)
    manifest = _read_json(directory / "manifest.json")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{directory}: format_version {manifest.get('format_version')!r} is not the supported "
                         f"{FORMAT_VERSION}")
    if manifest.get("kind") not in KINDS:
        raise ValueError(f"{directory}: unknown predictor kind {manifest.get('kind')!r}; known: {', '.join(KINDS)}")
    missing = [name for name in manifest.get("files", []) if not (directory / name).is_file()]
    if missing:
        raise ValueError(f"{directory}: files named in the manifest are missing: {', '.join(missing)}")
    return manifest


def trained_for(path: Path | str) -> str | None:
    """The model whose output lengths the artifact at `path` learnt, None when it does not say."""
    return read_manifest(path).get("model")


def load_predictor(path: Path | str) -> FittedLengthPredictor:
    """The ready-to-use predictor saved at `path` (a version directory, or a root through LATEST)."""
    directory = resolve_version_dir(path)
    manifest = read_manifest(directory)
    params = _read_json(directory / "params.json")
    try:
        if manifest["kind"] == "mean":
            predictor = MeanLengthPredictor.from_params(params)
        elif manifest["kind"] == "linear":
            predictor = PromptLengthLinearPredictor.from_params(params)
        elif manifest["kind"] == "table":
            predictor = TableLengthPredictor.from_params(params)
        elif manifest["kind"] == "transformer":
            predictor = TransformerLengthPredictor.load(params, directory)
        else:
            feature_config = FeatureConfig.from_dict(_read_json(directory / "features.json"))
            predictor = LightGBMLengthPredictor.load(params, feature_config, directory)
    except (KeyError, TypeError) as error:
        raise ValueError(f"{directory}/params.json does not fit a {manifest['kind']} predictor: {error!r}") from None
    conformal = _read_json(directory / "calibration.json").get("conformal")
    if conformal is not None:
        try:
            predictor.calibration = BoundCalibration.from_dict(conformal)
        except TypeError as error:
            raise ValueError(f"{directory}/calibration.json: bad conformal calibration ({error})") from None
    return predictor
