"""The predictor over Ray Serve: answers batched calls, hot-reloads a promoted version, starts from the baseline."""

import json
import re
from pathlib import Path

import pytest

from predictor_service.artifacts import save_predictor
from predictor_service.length_example import LengthExample
from predictor_service.artifacts import load_predictor, read_manifest
from predictor_service.server import (BASELINE_VERSION, DEFAULT_ARTIFACT_ROOT, SHIPPED_LABEL_FILES,
                                     LengthPredictorServer)
from predictor_service.training import make_predictor, read_labels

PAYLOAD = {"prompt_id": "q", "prompt_text": "Write an essay about rivers.", "num_prompt_tokens": 30,
           "max_tokens": 900, "temperature": 0.0}


def fitted_mean(value: int):
    examples = [LengthExample(f"p{i}", "x", 10, 900) for i in range(20)]
    return make_predictor("mean", 0.9, 1024).fit(examples, [value] * 20)


def test_server_starts_from_the_shipped_default_artifact_and_switches_to_a_promoted_version(tmp_path: Path):
    server = LengthPredictorServer(tmp_path / "artifacts")
    assert server.version.startswith("default:lightgbm-v0001-")
    [answer] = server.predict([PAYLOAD])
    assert 1 <= answer["point_tokens"] <= answer["upper_bound_tokens"] <= 900
    assert abs(sum(answer["bucket_probs"]) - 1.0) < 1e-6
    assert not server.reload_if_promoted()
    save_predictor(fitted_mean(77), tmp_path / "artifacts", {}, {})
    assert server.reload_if_promoted()
    assert server.predict([PAYLOAD])[0]["point_tokens"] == 77
    assert re.match(r"mean-v0001-", server.version)


def test_a_model_the_shipped_artifact_did_not_learn_starts_from_the_max_tokens_prior(tmp_path: Path):
    from predictor_service.server import PRIOR_VERSION

    server = LengthPredictorServer(tmp_path / "artifacts", max_len=1024, model="gemma3-270m")
    assert server.version == PRIOR_VERSION
    [answer] = server.predict([PAYLOAD])
    assert answer["upper_bound_tokens"] == 900 and answer["point_tokens"] == 450  # nothing known but max_tokens
    assert max(answer["bucket_probs"][9:]) < 0.05 and abs(sum(answer["bucket_probs"]) - 1.0) < 1e-6
    save_predictor(fitted_mean(120), tmp_path / "artifacts", {}, {}, "gemma3-270m")  # retraining promotes one
    assert server.reload_if_promoted() and server.predict([PAYLOAD])[0]["point_tokens"] == 120
    assert LengthPredictorServer(tmp_path / "none", model="smollm2-135m-instruct").version.startswith("default:")


def test_without_the_default_artifact_the_server_fits_the_prompt_length_baseline():
    server = LengthPredictorServer(None, default_root=None)
    assert server.version == BASELINE_VERSION
    [answer] = server.predict([PAYLOAD])
    assert 1 <= answer["point_tokens"] <= answer["upper_bound_tokens"] <= 900


def test_shipped_default_artifact_is_calibrated_lightgbm_without_torch_features():
    manifest = read_manifest(DEFAULT_ARTIFACT_ROOT)
    assert manifest["kind"] == "lightgbm"
    assert json.loads((DEFAULT_ARTIFACT_ROOT / "v0001" / "features.json").read_text())["use_embedding"] is False
    assert sum(f.stat().st_size for f in (DEFAULT_ARTIFACT_ROOT / "v0001").iterdir()) < 5_000_000
    predictor = load_predictor(DEFAULT_ARTIFACT_ROOT)
    shipped = read_labels(SHIPPED_LABEL_FILES)
    # Calibrated out of fold over every shipped label, greedy and sampled: retrain it whenever the labels grow.
    assert predictor.calibration is not None and predictor.calibration.num_calibration == len(shipped)
    assert {row.temperature for row in shipped} == {0.0, 1.0}
    prompts = ["Answer with one word: what is the capital of France?",
               "Write a long, detailed story about a dragon who learns to code."]
    short, long = predictor.predict_examples([LengthExample(str(i), p, 40, 980) for i, p in enumerate(prompts)])
    assert short.point_tokens < long.point_tokens
    # Trained on sampled answers too, it answers per temperature (sampled answers run longer here)
    sampled = predictor.predict_examples([LengthExample(str(i), p, 40, 980, 1.0) for i, p in enumerate(prompts)])
    assert [s.point_tokens for s in sampled] != [short.point_tokens, long.point_tokens]


def test_server_rejects_a_payload_without_lengths(tmp_path: Path):
    server = LengthPredictorServer(None)
    with pytest.raises(KeyError):
        server.predict([{"prompt_text": "hi"}])


@pytest.mark.slow
def test_ray_serve_deployment_batches_and_hot_reloads(tmp_path: Path):
    import ray
    from ray import serve

    from predictor_service.deployment import build_predictor_app

    root = tmp_path / "artifacts"
    save_predictor(fitted_mean(50), root, {}, {})
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        handle = serve.run(build_predictor_app({"artifact_root": str(root)}), name="predictor", route_prefix=None)
        responses = [handle.predict.remote({**PAYLOAD, "prompt_id": f"q{i}"}) for i in range(40)]
        answers = [r.result(timeout_s=60) for r in responses]
        assert {a["point_tokens"] for a in answers} == {50}
        save_predictor(fitted_mean(120), root, {}, {})
        after = handle.predict.remote(PAYLOAD).result(timeout_s=60)
        assert after["point_tokens"] == 120 and after["version"].startswith("mean-v0002-")
    finally:
        serve.shutdown()
        ray.shutdown()
