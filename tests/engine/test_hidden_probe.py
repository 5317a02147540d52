"""The hidden-state length probe: rows taken from the engine's own forward, a probe trained on them, and the
engine re-bounding sequences with it (tiny random Llama; the shipped probe is scored by `bench predictor`)."""

import copy
from dataclasses import replace

import numpy as np
import pytest
import torch

from cluster.control.worker_probe import PredictorLengthProbe, load_length_probe
from predictor_service.hidden_probe import HiddenStateProbe, ProbeConfig
from predictor_service.metrics import kendall_tau
from s3serve_cli.probe_features import FeatureJob, HiddenStateRecorder, extract_hidden_features
from workers.actors.worker_actor import build_engine
from workers.actors.worker_settings import WorkerSettings
from workers.engine.engine import Engine, EngineConfig
from workers.engine.models import make_tiny_model
from workers.engine.worker_snapshot import LoopCounters, snapshot
from workers.scheduling.length_probe import LengthProbe, ProbeQuery, RemainingEstimate, refined_bound, remaining_for
from workers.scheduling.policies import PagedGreedyPolicy
from workers.scheduling.s3_peak import S3PeakPolicy
from workers.scheduling.s3_policy import S3Policy
from workers.values.sampling_params import SamplingParams
from workers.values.work_types import BoundReport

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BLOCK_SIZE = 4
BYTES_PER_BLOCK = 2 * 2 * BLOCK_SIZE * 2 * 16 * 4


def _engine(model, probe=None, use_fast_path=True, policy=None, **fields) -> Engine:
    config = dict(kv_cache_bytes=256 * BYTES_PER_BLOCK, block_size=BLOCK_SIZE, max_num_seqs=8,
                  max_num_batched_tokens=64, max_model_len=128, use_fast_path=use_fast_path)
    config.update(fields)
    return Engine(copy.deepcopy(model), EngineConfig.of(**config), policy=policy, probe=probe)


@pytest.mark.parametrize("use_fast_path", [True, False], ids=["fast", "hf"])
def test_engine_hands_the_probe_the_final_norm_hidden_state_of_the_sampled_row(use_fast_path):
    model = make_tiny_model(seed=5, init_std=0.2)
    prompt = torch.randint(3, 256, (13,), generator=torch.Generator().manual_seed(5)).tolist()
    recorder = HiddenStateRecorder(interval_tokens=3, last_checkpoint_tokens=6)
    engine = _engine(model, recorder, use_fast_path=use_fast_path)
    assert engine.runner.path == ("fast" if use_fast_path else "hf")
    [output] = engine.generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True))
    assert sorted(n for _, n in recorder.rows) == [0, 3, 6]  # the prefill's sample, then every 3 decoded tokens
    with torch.inference_mode():
        tokens = torch.tensor([prompt + output])
        want = model.model(tokens).last_hidden_state[0]  # [T, hidden], HF's own forward, final norm applied
    for (_, decoded), row in recorder.rows.items():
        # the row that samples output token `decoded` is the state of the token before it
        torch.testing.assert_close(torch.from_numpy(row).float(), want[len(prompt) + decoded - 1], atol=2e-3,
                                   rtol=2e-3)


class _FixedProbe(LengthProbe):
    """Answers the same remaining length at every read (point 3, bound `upper`); records what it was asked."""

    def __init__(self, upper: int, interval_tokens: int) -> None:
        self.upper = upper
        self.interval_tokens = interval_tokens
        self.asked: list[ProbeQuery] = []

    def estimate_remaining(self, hidden, queries):
        assert hidden.dtype == torch.float32 and hidden.shape[0] == len(queries)
        self.asked.extend(queries)
        return [RemainingEstimate(3, self.upper)] * len(queries)


@pytest.mark.parametrize("policy", [S3Policy(bucket_tokens=8), S3PeakPolicy(bucket_tokens=8)], ids=["s3", "s3_peak"])
def test_reprediction_rewrites_the_bound_the_policies_plan_by(policy):
    model = make_tiny_model(seed=6, init_std=0.2)
    probe = _FixedProbe(upper=3 if policy.holds_plan else 7, interval_tokens=5)  # s3 takes the bound, s3_peak the point
    engine = Engine(copy.deepcopy(model), EngineConfig.of(kv_cache_bytes=256 * BYTES_PER_BLOCK, block_size=BLOCK_SIZE,
                                                       max_model_len=128), policy=policy, probe=probe)
    seq_id = engine.add_request([5, 6, 7, 8], SamplingParams(max_tokens=20, ignore_eos=True),
                                predicted_output_tokens=17)
    forced_id = engine.add_request([9, 10, 11], SamplingParams(max_tokens=20, forced_output_tokens=12))
    engine.step()  # both prompts prefill and sample their first token
    assert engine.sequence(seq_id).predicted_output_tokens == 0 + 3  # the router's 17 replaced after prefill
    if policy.holds_plan:  # s3 reserved 4 + 17 tokens (24) at admission and gives back what 4 + 3 do not need
        assert engine.allocator.num_reserved_tokens(seq_id) == 8
    for _ in range(5):
        engine.step()
    assert engine.sequence(seq_id).predicted_output_tokens == 5 + 3  # re-predicted after 5 decoded tokens
    assert {q.seq_id for q in probe.asked} == {seq_id}  # forced lengths are not the model's to predict
    assert [q.num_output_tokens for q in probe.asked] == [0, 5]
    assert engine.sequence(forced_id).predicted_output_tokens is None
    assert engine.num_probe_reads == 2
    # The worker reports the re-bounded sequence, and only it, so that the controller plans by the same bound
    stats = snapshot(engine, "w1", LoopCounters(0, 0, 0))
    held = engine.allocator.num_reserved_tokens(seq_id)
    assert held >= 4 + 6 and stats.rebounded == (BoundReport(seq_id, 6, 5 + 3, held),)


def test_a_probe_that_reads_forced_lengths_re_bounds_them_too():
    model = make_tiny_model(seed=6, init_std=0.2)
    probe = _FixedProbe(upper=7, interval_tokens=5)
    probe.reads_forced = True  # the bench's forced lengths are the model's own (bench peers --workload natural)
    engine = Engine(copy.deepcopy(model), EngineConfig.of(kv_cache_bytes=256 * BYTES_PER_BLOCK, block_size=BLOCK_SIZE,
                                                       max_model_len=128), policy=S3PeakPolicy(bucket_tokens=8),
                    probe=probe)
    forced_id = engine.add_request([9, 10, 11], SamplingParams(max_tokens=20, forced_output_tokens=12),
                                   predicted_output_tokens=17)
    engine.step()
    assert [q.seq_id for q in probe.asked] == [forced_id]
    assert engine.sequence(forced_id).predicted_output_tokens == 0 + 3  # s3_peak plans by the point


def test_refined_bound_stays_inside_what_can_still_happen():
    query = ProbeQuery("a", num_prompt_tokens=10, num_output_tokens=30, max_tokens=40)
    assert refined_bound(query, 500, 35) == 40  # never past max_tokens
    assert refined_bound(query, 0, 35) == 31  # at least the token being sampled
    assert refined_bound(query, None, 35) == 35  # no answer: the bound stays
    estimate = RemainingEstimate(point_tokens=4, upper_tokens=9)
    assert remaining_for(estimate, holds_plan=True) == 9 and remaining_for(estimate, holds_plan=False) == 4
    assert remaining_for(None, holds_plan=True) is None


@pytest.mark.parametrize("hidden_units,ranking_weight", [(0, 0.0), (32, 0.5)], ids=["linear", "mlp-ranking"])
def test_a_trained_probe_ranks_unseen_rows_covers_its_bound_and_loads_back(tmp_path, hidden_units, ranking_weight,
                                                                           synthetic_probe_features):
    train, test = synthetic_probe_features(400, 24, seed=1), synthetic_probe_features(150, 24, seed=2)
    config = ProbeConfig(max_len=520, hidden_units=hidden_units, ranking_weight=ranking_weight, num_epochs=30)
    probe = HiddenStateProbe(config, hidden_size=24).fit(train)
    assert probe.calibration is not None and probe.calibration.num_calibration > 20
    out = probe.predict_rows(test.hidden, test.num_prompt_tokens, test.num_output_tokens, test.max_tokens)
    assert kendall_tau(out.point_remaining, test.remaining_tokens) > 0.7
    assert np.mean(test.remaining_tokens <= out.upper_remaining) >= 0.8  # calibrated for 0.9 on other prompts
    assert np.all(out.upper_remaining >= out.point_remaining)
    assert out.bucket_probs.shape == (len(test), 10)
    loaded = HiddenStateProbe.load(probe.save(tmp_path / "probe"))
    assert loaded.last_read_tokens == probe.last_read_tokens == 128
    again = loaded.predict_rows(test.hidden, test.num_prompt_tokens, test.num_output_tokens, test.max_tokens)
    assert np.array_equal(again.upper_remaining, out.upper_remaining)
    with pytest.raises(ValueError, match=r"\[N, 24\]"):
        probe.predict_rows(test.hidden[:, :10], [1], [0], [5])


def test_loading_a_folder_without_a_probe_says_what_is_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="probe.json"):
        HiddenStateProbe.load(tmp_path)


def test_extracted_rows_train_a_probe_that_the_engine_then_reads_with():
    model = make_tiny_model(seed=7, vocab_size=16, init_std=0.3)  # a small vocabulary: EOS (2) comes up
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 16, (int(n),), generator=gen).tolist() for n in torch.randint(3, 20, (24,), generator=gen)]
    params = SamplingParams(max_tokens=40)
    outputs = _engine(model).generate(prompts, params)
    assert any(len(o) < 40 for o in outputs)  # some stop on EOS: their labels are checked below
    jobs = [FeatureJob(f"tiny:{i}", tuple(p), 40, len(o)) for i, (p, o) in enumerate(zip(prompts, outputs))]
    stopped = next(i for i, o in enumerate(outputs) if len(o) < 40)
    jobs.append(FeatureJob("tiny:wrong", tuple(prompts[stopped]), 40, len(outputs[stopped]) + 5))  # ran on, it says
    long_run = next(i for i, o in enumerate(outputs) if len(o) == 40)
    jobs.append(FeatureJob("tiny:short", tuple(prompts[long_run]), 40, 10))  # stopped at 10, it says; it does not
    features, report = extract_hidden_features(model, jobs, max_len=128, interval_tokens=8, last_checkpoint_tokens=16,
                                               max_num_seqs=8, kv_cache_bytes=256 * BYTES_PER_BLOCK)
    assert set(report.disagreeing_prompt_ids) == {"tiny:wrong", "tiny:short"}  # both left out, both ways caught
    assert set(features.num_output_tokens) <= {0, 8, 16} and 0 in features.num_output_tokens
    assert len(set(features.prompt_ids)) == len(prompts)
    assert np.all(features.remaining_tokens >= 1)

    probe = HiddenStateProbe(ProbeConfig(max_len=128, hidden_units=16, interval_tokens=8, num_epochs=5),
                             hidden_size=model.config.hidden_size).fit(features)
    engine = _engine(model, PredictorLengthProbe(probe), policy=S3PeakPolicy(bucket_tokens=8))
    seq_id = engine.add_request(prompts[0], SamplingParams(max_tokens=40, ignore_eos=True), predicted_output_tokens=40)
    engine.step()
    first = engine.sequence(seq_id).predicted_output_tokens
    assert 1 <= first <= 40 and engine.num_probe_reads == 1
    for _ in range(8):
        engine.step()
    assert engine.num_probe_reads == 2
    assert 9 <= engine.sequence(seq_id).predicted_output_tokens <= 40  # re-bounded from 8 decoded tokens on


def test_the_shipped_probe_loads_for_the_default_model_only():
    probe = load_length_probe("default", hidden_size=576)  # SmolLM2-135M's width
    assert isinstance(probe, LengthProbe) and probe.predictor.calibration is not None and probe.interval_tokens == 64
    queries = [ProbeQuery("a", 40, 0, 900), ProbeQuery("b", 40, 256, 900)]
    estimates = probe.estimate_remaining(torch.randn(2, 576), queries)
    assert all(1 <= e.point_tokens <= e.upper_tokens <= q.max_remaining_tokens for e, q in zip(estimates, queries))
    with pytest.raises(ValueError, match="hidden states of size 576, the model has 96"):
        load_length_probe("default", hidden_size=96)


def test_a_worker_builds_its_probe_with_the_loader_it_is_given():
    settings = WorkerSettings.of(tiny_model_seed=0, dtype="float32", length_probe="some/probe", policy="s3_peak",
                              kv_cache_memory=64 * BYTES_PER_BLOCK, block_size=BLOCK_SIZE, max_model_len=128)
    with pytest.raises(ValueError, match="no probe loader"):
        build_engine(settings)
    asked = []

    def load(spec, hidden_size):
        asked.append((spec, hidden_size))
        return _FixedProbe(upper=3, interval_tokens=1)

    engine = build_engine(settings, load_probe=load)
    assert asked == [("some/probe", 96)] and isinstance(engine.probe, _FixedProbe)  # the tiny model's width
    assert build_engine(replace(settings, length_probe=None)).probe is None  # no probe named: no loader needed


def test_policies_that_ignore_predictions_never_run_the_probe():
    model = make_tiny_model(seed=8, init_std=0.2)
    probe = _FixedProbe(upper=3, interval_tokens=1)
    engine = Engine(copy.deepcopy(model), EngineConfig.of(kv_cache_bytes=256 * BYTES_PER_BLOCK, block_size=BLOCK_SIZE,
                                                       max_model_len=128), policy=PagedGreedyPolicy(), probe=probe)
    seq_id = engine.add_request([5, 6, 7], SamplingParams(max_tokens=6, ignore_eos=True), predicted_output_tokens=5)
    engine.step()
    assert engine.probe is None and probe.asked == [] and engine.num_probe_reads == 0
    assert engine.sequence(seq_id).predicted_output_tokens == 5


def test_a_trained_probe_reads_only_as_far_as_its_training_rows_went(synthetic_probe_features):
    probe = HiddenStateProbe(ProbeConfig(max_len=520, hidden_units=0, num_epochs=2, interval_tokens=64),
                             hidden_size=8).fit(synthetic_probe_features(60, 8, seed=5))
    assert probe.last_read_tokens == 128  # the synthetic rows sit at 0, 64 and 128 decoded tokens
    assert [n for n in (0, 64, 100, 128, 192, 256) if probe.reads_at(n)] == [0, 64, 128]
    assert [n for n in (0, 64, 100, 128, 192, 256) if PredictorLengthProbe(probe).is_due(n)] == [0, 64, 128]
