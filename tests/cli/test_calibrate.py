"""`s3serve calibrate`: the model's own labels, a predictor and a probe that name it, and the service's warning when
the predictor it serves learnt another model's lengths."""

import json

import pytest

from cluster.config import ServiceConfig
from s3serve_cli.main import main
from s3serve_cli.serve import predictor_warning


def _artifact_root(root, model: str):
    """An artifact root as training leaves it: LATEST naming a version whose manifest names `model`."""
    (root / "v0001").mkdir(parents=True)
    (root / "v0001" / "manifest.json").write_text(json.dumps({"format_version": 1, "kind": "mean",
                                                              "version": "mean-v0001", "files": [], "model": model}))
    (root / "LATEST").write_text("v0001\n")
    return root


def test_the_service_warns_when_its_predictor_learnt_another_models_lengths(tmp_path):
    assert predictor_warning(ServiceConfig(data_dir=str(tmp_path))) is None  # the shipped one, for SmolLM2
    note = predictor_warning(ServiceConfig(model="gemma3-270m", data_dir=str(tmp_path)))
    assert "no length predictor for gemma3-270m yet" in note and "by its max_tokens" in note
    assert "s3serve calibrate --model gemma3-270m" in note
    other = _artifact_root(tmp_path / "other", "smollm2-135m-instruct")
    warning = predictor_warning(ServiceConfig(model="gemma3-270m", predictor_artifact=str(other)))
    assert "learnt smollm2-135m-instruct's output lengths, not gemma3-270m's" in warning
    own = _artifact_root(tmp_path / "own", "gemma3-270m")
    assert predictor_warning(ServiceConfig(model="gemma3-270m", predictor_artifact=str(own))) is None


@pytest.mark.slow
def test_calibrate_labels_trains_both_and_resumes(tmp_path, model_cache_dir, shared_data, capsys):
    out = tmp_path / "cal"
    args = ["calibrate", "--model-cache-dir", str(model_cache_dir), "--prompts",
            str(shared_data / "prompts" / "pool.jsonl"), "--limit", "24", "--max-len", "128", "--out", str(out)]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "Kendall tau" in printed and f"--predictor-artifact {out / 'predictor'}" in printed
    labels = (out / "labels.jsonl").read_text().splitlines()
    assert 10 <= len(labels) <= 24 and all(json.loads(row)["model"] == "smollm2-135m-instruct" for row in labels)
    manifest = json.loads((out / "predictor" / "v0001" / "manifest.json").read_text())
    assert manifest["model"] == "smollm2-135m-instruct" and manifest["kind"] == "linear"
    probe = json.loads((out / "probe" / "probe.json").read_text())
    assert probe["metrics"]["model"] == "smollm2-135m-instruct" and probe["hidden_size"] == 576
    report = json.loads((out / "calibration.json").read_text())
    assert report["labels"]["labelled"] + report["labels"]["skipped_too_long"] == 24
    # 24 prompts hold no two sources of 30: no leave-source-out score, so the first candidate kind is fitted
    assert report["predictor"]["recipe"]["kind"] == "linear" and report["predictor"]["recipe"]["source_tau"] is None
    assert "leave-source-out tau n/a" in printed
    # again (without the probe, whose extraction the first run covered: CI time): nothing is labelled twice, a
    # second predictor version is trained
    assert main([*args, "--no-probe"]) == 0
    assert len((out / "labels.jsonl").read_text().splitlines()) == len(labels)
    assert (out / "predictor" / "LATEST").read_text().strip() == "v0002"
