"""The cluster simulator: the engine's own scheduling on a modelled clock, and the step-time models."""

import random

import pytest

from benchmarks.cluster_sim import ClusterSimulation
from benchmarks.sim_worker import SimConfig, SimRequest, simulate_worker
from benchmarks.step_time import (LinearStepModel, RooflineStepModel, calibration_error, fit_linear, gpu_kind,
                                  shape_cost)
from workers.engine.engine import Engine
from workers.engine.model_shapes import MODEL_SHAPES, shape_parameters
from workers.engine.models import make_tiny_model
from workers.scheduling.engine_config import EngineConfig
from workers.scheduling.policies import make_policy
from workers.values.sampling_params import SamplingParams
from workers.values.step_output import StepShape

POLICIES = ("max_reserve", "paged_greedy", "s3", "s3_peak", "oracle")
MAX_LEN = 256
CONSTANT = LinearStepModel(0.01, 0.0, 0.0, 0.0, kv_bytes_per_token=1000)  # 10 ms per step, whatever runs


def _requests(n: int, seed: int = 0, bound_scale: float = 1.3) -> list[SimRequest]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt, output = rng.randint(5, 60), rng.randint(1, 150)
        out.append(SimRequest(f"r{i}", 0.0, prompt, output, MAX_LEN - prompt,
                              max(1, min(MAX_LEN - prompt, round(output * bound_scale * rng.uniform(0.5, 1.5))))))
    return out


def _simulate(policy: str, requests, num_workers: int = 2, num_blocks: int = 64, model=CONSTANT, **kwargs):
    config = SimConfig(num_workers, num_blocks, block_size=16, max_num_seqs=32, max_num_batched_tokens=128, **kwargs)
    simulation = ClusterSimulation(config, lambda: make_policy(policy, max_model_len=MAX_LEN), model,
                                   record_steps=True)
    return simulation, simulation.run(requests)


@pytest.mark.parametrize("policy", POLICIES)
def test_every_request_finishes_with_its_forced_length(policy):
    requests = _requests(60)
    _, result = _simulate(policy, requests)
    assert result.outputs_exact
    assert len(result.latency_s) == 60
    assert result.output_tokens == sum(r.num_output_tokens for r in requests)
    assert result.makespan_s == pytest.approx(max(result.latency_s))
    assert min(result.ttft_s) > 0 and max(result.ttft_s) <= max(result.latency_s)


def test_max_reserve_runs_only_what_worst_case_reservation_fits():
    _, result = _simulate("max_reserve", _requests(40), num_workers=1, num_blocks=64)
    fits = 64 * 16 // MAX_LEN  # 4 sequences of MAX_LEN tokens
    assert max(shape.num_seqs for shape, _ in result.step_samples) == fits
    assert result.num_preemptions == 0
    _, paged = _simulate("paged_greedy", _requests(40), num_workers=1, num_blocks=64)
    assert max(shape.num_seqs for shape, _ in paged.step_samples) > fits
    assert paged.tokens_per_s > result.tokens_per_s  # 10 ms a step whatever its size: batching pays


def test_a_worker_schedules_exactly_as_the_real_engine():
    """Same requests, same policy and budget: the simulated worker's steps are the engine's steps."""
    requests = _requests(24, seed=3)
    model = make_tiny_model()
    num_preempted = 0
    for policy in ("s3", "paged_greedy"):
        engine = Engine(model, EngineConfig.of(kv_cache_bytes=48 * 16 * 2 * 2 * 2 * 16 * 4, max_num_seqs=32,
                                            max_num_batched_tokens=128, max_model_len=MAX_LEN,
                                            prefix_caching=False),
                        policy=make_policy(policy, max_model_len=MAX_LEN))
        rng = random.Random(1)
        for r in requests:
            engine.add_request([rng.randrange(256) for _ in range(r.num_prompt_tokens)],
                               SamplingParams(max_tokens=r.max_tokens, ignore_eos=True,
                                              forced_output_tokens=r.num_output_tokens),
                               seq_id=r.request_id, predicted_output_tokens=r.predicted_output_tokens)
        real = []
        while engine.has_unfinished():
            engine.step()
            if engine.last_num_scheduled:
                real.append(engine.last_shape)
        config = SimConfig(1, engine.allocator.num_blocks, block_size=16, max_num_seqs=32, max_num_batched_tokens=128)
        result = simulate_worker(requests, config, make_policy(policy, max_model_len=MAX_LEN), CONSTANT)
        assert [shape for shape, _ in result.step_samples] == real, policy
        assert result.num_preemptions == engine.scheduler.stats.num_preemptions
        # 10 ms a step, plus the swap copies of preempted sequences (kilobytes at 5 GB/s: microseconds)
        assert result.outputs_exact and result.makespan_s == pytest.approx(0.01 * len(real), rel=1e-3)
        num_preempted += result.num_preemptions
    assert num_preempted > 0  # the budget is tight enough that preemption paths ran too


def test_under_predicted_overruns_move_to_a_worker_with_room():
    # Bounds of one token and a small cache: s3 sequences outrun their reservations and get preempted;
    # the controller moves them where their next bound fits, and nothing is lost.
    rng = random.Random(7)
    requests = [SimRequest(f"r{i}", 0.0, 20, rng.randint(100, 200), MAX_LEN - 20, 1) for i in range(24)]
    _, result = _simulate("s3", requests, num_workers=3, num_blocks=40, tick_s=0.05)
    assert result.num_mispredictions > 0 and result.num_preemptions > 0
    assert result.num_migrations >= 1
    assert result.outputs_exact and len(result.latency_s) == 24


def test_a_drained_worker_takes_a_live_request_from_the_busy_one_between_its_steps():
    # paged_greedy plans only the prompt: all four are placed at once, alternating w0, w1, w0, w1 (by room); w1's
    # answers are short, so w0 would decode both long ones alone. A step costs 10 ms + 10 ms per sequence. Every
    # prediction says 8 tokens: by counts (room routing) the long ones are told apart by what is still live.
    per_seq = LinearStepModel(0.01, 0.01, 0.0, 0.0, kv_bytes_per_token=1000)
    requests = [SimRequest(f"r{i}", 0.0, 20, n, MAX_LEN - 20, 8) for i, n in enumerate((150, 5, 150, 5))]
    simulation, balanced = _simulate("paged_greedy", requests, model=per_seq, tick_s=0.05, routing="room")
    _, alone = _simulate("paged_greedy", requests, model=per_seq, tick_s=0.05, rebalance_min_gap=0, routing="room")
    assert (balanced.num_rebalances, balanced.num_migrations) == (1, 1) and alone.num_migrations == 0
    assert balanced.outputs_exact and alone.outputs_exact
    assert balanced.output_tokens == alone.output_tokens == 310
    # the moved long answer decodes beside the other instead of behind it in the same batch
    assert balanced.makespan_s < 0.8 * alone.makespan_s
    assert not simulation.rebalanced and simulation.pending_move is None  # nothing left behind


def test_rebalance_min_gap_1_is_refused():
    with pytest.raises(ValueError, match="rebalance_min_gap must be 0 .off. or at least 2"):
        SimConfig(2, 64, rebalance_min_gap=1)


def test_a_full_controller_queue_refuses_and_the_clients_retry():
    requests = _requests(80)
    _, result = _simulate("max_reserve", requests, num_workers=2, max_pending=4)
    assert result.num_refused > 0
    assert result.outputs_exact and len(result.latency_s) == 80


def test_more_workers_serve_a_proportional_load_faster():
    small = _simulate("s3", _requests(40), num_workers=2)[1]
    twice = _requests(40) + [SimRequest(f"x{r.request_id}", 0.0, r.num_prompt_tokens, r.num_output_tokens,
                                        r.max_tokens, r.predicted_output_tokens) for r in _requests(40)]
    large = _simulate("s3", twice, num_workers=4)[1]
    assert large.tokens_per_s > 1.6 * small.tokens_per_s


@pytest.mark.parametrize("field", ["num_workers", "num_blocks", "max_pending"])
def test_impossible_clusters_are_errors(field):
    kwargs = {"num_workers": 2, "num_blocks": 64, "max_pending": 8, field: 0}
    with pytest.raises(ValueError, match=f"{field} must be >= 1"):
        SimConfig(**kwargs)


# -- step-time models -------------------------------------------------------------------


def test_roofline_decode_is_nearly_flat_in_batch_for_a_7b_model_on_an_a100():
    model = RooflineStepModel(gpu_kind("a100-80gb"), shape_cost("llama-7b"))
    decode = [model.step_s(StepShape(n, n, 100 * n, 100 * n)) for n in (1, 4, 16, 64)]
    assert decode == sorted(decode)
    assert decode[3] < 2 * decode[1]  # the paper's regime: batch 64 costs well under twice batch 4
    prefill = model.step_s(StepShape(1, 2048, 2048, 2048 * 2049 // 2))
    assert prefill > 3 * decode[0]  # a long prefill is compute bound
    assert shape_cost("llama-7b").kv_bytes_per_token == 2 * 32 * 4096 * 2


def test_shapes_have_their_models_sizes_and_the_larger_ones_leave_an_a100_little_kv():
    # Parameter counts as published (embeddings counted once: the shapes tie them to the output layer).
    for name, billions in (("llama-7b", 6.74), ("llama-13b", 13.02), ("llama-30b", 32.53)):
        assert shape_parameters(name) / 1e9 == pytest.approx(billions - 32000 * MODEL_SHAPES[name]["hidden_size"]
                                                             / 1e9, rel=0.01)
    kv_room = {name: 0.9 * gpu_kind("a100-80gb").memory_bytes - shape_cost(name).weight_bytes
               for name in ("llama-7b", "llama-13b", "llama-30b")}
    sequences = {name: room / (2048 * shape_cost(name).kv_bytes_per_token) for name, room in kv_room.items()}
    assert sequences["llama-7b"] > sequences["llama-13b"] > sequences["llama-30b"] > 2


def test_linear_fit_recovers_known_coefficients():
    truth = LinearStepModel(0.004, 0.0002, 0.00003, 0.0000002)
    rng = random.Random(0)
    samples = []
    for _ in range(50):
        seqs = rng.randint(1, 32)
        tokens = seqs + rng.randint(0, 200)
        shape = StepShape(seqs, tokens, tokens + rng.randint(0, 5000), 0)
        samples.append((shape, truth.step_s(shape)))
    fitted = fit_linear(samples)
    for name in ("overhead_s", "per_seq_s", "per_token_s", "per_context_token_s"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-6)
    error = calibration_error(fitted, samples)
    assert error.mean_abs_pct < 1e-6 and abs(error.total_pct) < 1e-6
    assert calibration_error(LinearStepModel(0.008, 0.0004, 0.00006, 0.0000004), samples).total_pct == \
        pytest.approx(100.0)


def test_bad_names_and_too_few_samples_are_clear_errors():
    with pytest.raises(ValueError, match="unknown GPU kind 'v100'"):
        gpu_kind("v100")
    with pytest.raises(ValueError, match="unknown model shape"):
        shape_cost("llama-70b")
    with pytest.raises(ValueError, match="at least 8"):
        fit_linear([(StepShape(1, 1, 1, 1), 0.01)])


@pytest.mark.parametrize("policy, runs_together", [("s3_peak", 2), ("s3", 1)])
def test_requests_are_planned_by_the_estimate_the_policy_chooses(policy, runs_together):
    # Two 10-token prompts with 20-token answers; the predictor's point says 20, its upper bound 200.
    # One worker of 16 blocks (256 tokens) holds both plans by the point, not both by the upper bound.
    # s3 is placed by its plan at the controller; s3_peak is charged its prompt there, and its worker's
    # future-peak test, planning by the point, is what lets both run.
    requests = [SimRequest(f"r{i}", 0.0, 10, 20, MAX_LEN - 10, 200, 20) for i in range(2)]
    _, result = _simulate(policy, requests, num_workers=1, num_blocks=16)
    assert max(shape.num_seqs for shape, _ in result.step_samples) == runs_together
    without_point = [SimRequest(f"r{i}", 0.0, 10, 20, MAX_LEN - 10, 200) for i in range(2)]
    _, result = _simulate(policy, without_point, num_workers=1, num_blocks=16)
    assert max(shape.num_seqs for shape, _ in result.step_samples) == 1


def test_the_steady_rate_counts_tokens_until_nine_in_ten_requests_have_finished():
    # 10 ms a step whatever runs; all ten prompts prefill in the first step, which samples their first tokens
    requests = [SimRequest(f"r{i}", 0.0, 8, 2, MAX_LEN - 8, 2) for i in range(9)]
    requests.append(SimRequest("long", 0.0, 8, 20, MAX_LEN - 8, 20))
    config = SimConfig(1, 64, block_size=16, max_num_seqs=10, max_num_batched_tokens=128)
    result = ClusterSimulation(config, lambda: make_policy("paged_greedy", max_model_len=MAX_LEN), CONSTANT).run(requests)
    assert result.output_tokens == 9 * 2 + 20 and result.makespan_s == pytest.approx(0.20)
    assert result.steady_s == pytest.approx(0.02)  # the ninth request finished in the second step
    assert result.steady_output_tokens == 20
    assert result.steady_tokens_per_s == pytest.approx(1000.0)
    assert result.tokens_per_s == pytest.approx(190.0)  # the drain: the long answer decoding alone


def test_by_predicted_work_the_worker_with_the_long_answers_gives_one_away():
    # As above, but predicted right (150 and 5 tokens) and routed by predicted work: the two long answers are
    # placed apart at once (no move needed); placed together by room, rebalancing by work moves one.
    per_seq = LinearStepModel(0.01, 0.01, 0.0, 0.0, kv_bytes_per_token=1000)
    requests = [SimRequest(f"r{i}", 0.0, 20, n, MAX_LEN - 20, n) for i, n in enumerate((150, 5, 150, 5))]
    _, routed = _simulate("paged_greedy", requests, model=per_seq, tick_s=0.05)  # predicted_work, the default
    _, room = _simulate("paged_greedy", requests, model=per_seq, tick_s=0.05, routing="room", rebalance_min_gap=0)
    assert routed.outputs_exact and routed.output_tokens == room.output_tokens == 310
    assert routed.makespan_s < 0.8 * room.makespan_s


@pytest.mark.parametrize("late_binding", [True, False])
def test_with_late_binding_what_no_worker_can_start_waits_at_the_controller_and_the_short_ones_go_first(late_binding):
    # Two workers of one slot each: while nothing waits on a worker it is sent its slot plus 2 (its own queue), so
    # the six long requests at t=0 fill both; the two short ones that come next wait at the controller, and each
    # takes the first place a long one frees, ahead of the longs still queued.
    requests = [SimRequest(f"long{i}", 0.0, 8, 50, MAX_LEN - 8, 50) for i in range(6)]
    requests += [SimRequest(f"short{i}", 0.001, 8, 3, MAX_LEN - 8, 3) for i in range(2)]
    config = SimConfig(2, 64, block_size=16, max_num_seqs=1, max_num_batched_tokens=128, late_binding=late_binding)
    result = ClusterSimulation(config, lambda: make_policy("s3_peak", max_model_len=MAX_LEN), CONSTANT).run(requests)
    assert result.outputs_exact and len(result.latency_s) == 8
    assert result.num_waited == (2 if late_binding else 0)
    assert (result.controller_wait_s > 0.4) == late_binding  # until the first long answers end (50 steps of 10 ms)
    latency = dict(zip(result.finished_ids, result.latency_s))
    assert max(latency["short0"], latency["short1"]) < min(latency[f"long{i}"] for i in range(2, 6))
