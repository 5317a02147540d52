"""The modelled clock: time moves by a step-time model, and an engine on it stamps arrivals and tokens with it."""

import copy

import pytest

from benchmarks.modelled_clock import IDLE_STEP_S, ModelledClock
from benchmarks.step_time import LinearStepModel
from workers.engine.engine import Engine, EngineConfig
from workers.values.sampling_params import SamplingParams
from workers.values.step_output import StepShape

BLOCK_SIZE = 4
BYTES_PER_BLOCK = 2 * 2 * BLOCK_SIZE * 2 * 16 * 4  # the tiny model's KV per block, fp32


def test_each_step_adds_the_models_time_for_its_shape_and_swaps_and_an_idle_gap_is_jumped():
    model = LinearStepModel(overhead_s=0.010, per_seq_s=0.001, per_token_s=0.0, per_context_token_s=0.0,
                            host_bytes_per_s=1e6)
    clock = ModelledClock(model)
    assert clock.now() == 0.0
    clock.step_ran(StepShape(2, 2, 50, 50), swapped_bytes=0)
    assert clock.now() == pytest.approx(0.012)
    clock.step_ran(StepShape(2, 2, 50, 50), swapped_bytes=500_000)  # half a second of host copies
    assert clock.now() == pytest.approx(0.524)
    clock.step_ran(None, swapped_bytes=0)  # nothing ran: time still moves, so waiting requests age
    assert clock.now() == pytest.approx(0.524 + IDLE_STEP_S)
    clock.wait_until(3.0)
    assert clock.now() == 3.0
    clock.wait_until(1.0)  # never backwards
    assert clock.now() == 3.0


def test_an_engine_on_the_modelled_clock_counts_latency_in_modelled_steps(tiny_model):
    second_a_step = LinearStepModel(overhead_s=1.0, per_seq_s=0.0, per_token_s=0.0, per_context_token_s=0.0)
    clock = ModelledClock(second_a_step)
    config = EngineConfig.of(kv_cache_bytes=64 * BYTES_PER_BLOCK, block_size=BLOCK_SIZE, max_num_seqs=4,
                             max_num_batched_tokens=16)
    engine = Engine(copy.deepcopy(tiny_model), config, clock=clock)
    engine.add_request(list(range(1, 9)), SamplingParams(max_tokens=3, ignore_eos=True), seq_id="a", arrival_s=0.0)
    finished = {}
    while engine.has_unfinished():
        finished.update({out.seq_id: out.metrics for out in engine.step() if out.is_finished})
    # one step prefills the 8 prompt tokens and samples the first token; two more decode: whatever the machine
    metrics = finished["a"]
    assert (metrics.ttft_s, metrics.latency_s) == (1.0, 3.0)
    assert clock.now() == 3.0
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=1, ignore_eos=True), seq_id="b")  # arrives now
    finished = {out.seq_id: out.metrics for out in engine.step() if out.is_finished}
    assert finished["b"].arrival_s == 3.0 and finished["b"].latency_s == 1.0


def _replay(tiny_model, clock):
    from tqdm import tqdm

    from benchmarks.policy_bench_config import PolicyBenchConfig
    from benchmarks.policy_replay import run_policy
    from benchmarks.traces import ReplayRequest

    requests = [ReplayRequest(f"r{i}", 0.05 * i, tuple(range(3 + i, 13 + 2 * i)), 4 + 3 * i, 0, 0) for i in range(6)]
    config = PolicyBenchConfig(max_len=64, max_num_seqs=2, max_num_batched_tokens=16, workload="trace")
    kv_bytes = 256 * BYTES_PER_BLOCK // BLOCK_SIZE  # 256 tokens of the tiny model's fp32 KV: some requests wait
    with tqdm(total=len(requests), disable=True) as progress:
        return run_policy(copy.deepcopy(tiny_model), "paged_greedy", requests, {}, config, kv_bytes, progress,
                          clock=clock)


def test_a_replay_on_the_modelled_clock_measures_the_same_latencies_however_fast_the_machine_runs(tiny_model):
    model = LinearStepModel(overhead_s=0.02, per_seq_s=0.005, per_token_s=0.001, per_context_token_s=0.0)
    first, again = _replay(tiny_model, ModelledClock(model)), _replay(tiny_model, ModelledClock(model))
    assert first.latency_s_by_request == again.latency_s_by_request and first.wall_s == again.wall_s
    assert first.queue_s == again.queue_s and max(first.queue_s) > 0  # two slots: later ones waited, alike
    # every step that ran is also measured on the wall clock (the speed gauge reads those)
    assert len(first.measured_steps) == sum(1 for step in first.steps if step[2]) and all(
        seconds > 0 for _, seconds in first.measured_steps)
