"""The roofline's arithmetic: a decode step's bytes and FLOPs, the binding limit, and the measured limits."""

import itertools

import pytest
import torch

from benchmarks import roofline
from benchmarks.engine_bench import decoder_shape, roofline_lines
from benchmarks.roofline import DecoderShape, Limits, StepCost, decode_step_cost, run_cost
from workers.engine.models import make_tiny_model, tiny_llama_config

SHAPE = DecoderShape(matmul_params=1000, head_params=300, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, bytes_per_param=2,
                     kv_bytes_per_token=2 * 2 * 2 * 8 * 2)


def test_a_step_reads_the_weights_once_and_each_sequences_kv():
    cost = decode_step_cost(SHAPE, [10, 30])
    assert cost.bytes == 1000 * 2 + 40 * 128
    # 2 FLOPs per weight per token, and Q.K + P.V: 2 x 2 FLOPs per head dim per context token per head per layer
    assert cost.flops == 2 * 1000 * 2 + 4 * 2 * 4 * 8 * 40


def test_a_run_reads_the_weights_each_step_and_prompts_skip_the_head():
    cost = run_cost(SHAPE, steps=10, prompt_tokens=50, output_tokens=20)
    assert cost.bytes == 10 * 1000 * 2
    assert cost.flops == 2 * 700 * 70 + 2 * 300 * 20


def test_batching_adds_flops_but_not_weight_bytes():
    one, many = decode_step_cost(SHAPE, [0]), decode_step_cost(SHAPE, [0] * 64)
    assert one.bytes == many.bytes == 2000
    assert many.flops == 64 * one.flops


def test_the_binding_limit_sets_the_floor():
    limits = Limits(bandwidth_gbs=10.0, peak_gflops=100.0)
    memory_bound = StepCost(bytes=1e9, flops=1e9)  # 0.1 s reading, 0.01 s computing
    assert limits.floor_s(memory_bound) == pytest.approx(0.1)
    assert limits.bound(memory_bound) == "memory"
    compute_bound = StepCost(bytes=1e8, flops=1e11)  # 0.01 s reading, 1 s computing
    assert limits.floor_s(compute_bound) == pytest.approx(1.0)
    assert limits.bound(compute_bound) == "compute"


def test_judging_a_step_gives_what_it_achieved_and_its_share_of_the_limit():
    judged = Limits(bandwidth_gbs=10.0, peak_gflops=100.0).judge(StepCost(bytes=1e9, flops=1e9), seconds=0.4)
    assert judged["achieved_gbs"] == pytest.approx(2.5)
    assert judged["achieved_gflops"] == pytest.approx(2.5)
    assert judged["floor_ms"] == pytest.approx(100.0)
    assert judged["share_of_limit"] == pytest.approx(0.25)
    assert judged["intensity_flops_per_byte"] == pytest.approx(1.0)


@pytest.mark.parametrize("tied", [True, False])
def test_a_tied_head_is_the_embedding_an_untied_one_its_own_matrix(tied):
    config = tiny_llama_config()
    config.tie_word_embeddings = tied
    embedding = config.vocab_size * config.hidden_size
    shape = DecoderShape.of(config, total_params=10 * embedding, bytes_per_param=4, kv_bytes_per_token=64)
    assert shape.matmul_params == (10 * embedding if tied else 9 * embedding)
    assert shape.head_params == embedding
    assert shape.head_dim == config.hidden_size // config.num_attention_heads
    assert shape.num_kv_heads == config.num_key_value_heads


def test_the_engine_bench_counts_a_real_models_weights_and_kv():
    model = make_tiny_model()
    shape = decoder_shape(model, torch.float32)
    config = model.config
    total = sum(p.numel() for p in model.parameters())
    # tied: the embedding is multiplied as the head; untied: the input embedding is only looked up
    untied_embedding = 0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size
    assert shape.matmul_params == total - untied_embedding
    head_dim = config.hidden_size // config.num_attention_heads
    assert shape.kv_bytes_per_token == config.num_hidden_layers * config.num_key_value_heads * head_dim * 2 * 4
    rows = roofline_lines([{"batch_size": 2, "step_ms": 10.0, "mid_contexts": [5.0, 7.0]}], shape,
                          Limits(bandwidth_gbs=1.0, peak_gflops=1.0))
    cost = decode_step_cost(shape, [5.0, 7.0])
    assert rows[0]["bytes_per_step"] == cost.bytes and rows[0]["flops_per_step"] == cost.flops
    assert rows[0]["share_of_limit"] == pytest.approx(max(cost.bytes, cost.flops) / 1e9 / 0.01)


def test_the_measurements_divide_the_work_by_the_best_time(monkeypatch):
    clock = itertools.count(step=0.5)  # every perf_counter call half a second later: each timed run takes 0.5 s
    monkeypatch.setattr(roofline.time, "perf_counter", lambda: next(clock))
    assert roofline.measure_bandwidth_gbs(buffer_bytes=4 << 20, repeats=2) == pytest.approx((4 << 20) / 0.5 / 1e9)
    assert roofline.measure_peak_gflops(torch.float32, size=64, repeats=2) == pytest.approx(2 * 64**3 / 0.5 / 1e9)


def test_the_host_probe_reads_a_quarter_gib_three_times_and_keeps_the_best(monkeypatch):
    calls = []
    monkeypatch.setattr(roofline, "measure_bandwidth_gbs", lambda buffer_bytes, repeats: calls.append(
        (buffer_bytes, repeats)) or 17.5)
    assert roofline.host_bandwidth_gbs() == 17.5 and calls == [(256 << 20, 3)]


def test_the_measured_limits_are_plausible():
    limits = roofline.Limits(roofline.measure_bandwidth_gbs(buffer_bytes=64 << 20, repeats=2),
                             roofline.measure_peak_gflops(torch.float32, size=256, repeats=2))
    assert 0.1 < limits.bandwidth_gbs < 10_000
    assert 0.1 < limits.peak_gflops < 1_000_000
