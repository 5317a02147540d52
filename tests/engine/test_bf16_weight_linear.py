"""`s3_cpu.bf16_weight_linear` (fp32 arithmetic over bf16 weights) against F.linear on the widened weights; when
`dtype auto` means it (`workers.engine.linear_weights`), and the model it runs."""

import pytest
import torch
import torch.nn.functional as F

from kv_kernels import cpu_build, cpu_kernels
from workers.engine import cpu_kind, linear_weights
from workers.engine.linear_weights import (bf16_copy_bytes, has_bf16_linear_weights, reads_bf16_weights,
                                          round_linear_weights_to_bf16)
from workers.engine.models import make_tiny_model

cpu_build.load()  # a failed build fails these tests (no skip): the engine's CPU path needs it


# M: every micro-kernel size (1-6 tokens), uneven blocks (16 = 6 + 5 + 5) and more than one L2 chunk of x rows
# (K 1536: 42 rows); N: whole 16-column panels and a padded last one; K: any, odd too
@pytest.mark.parametrize("tokens", [1, 2, 3, 5, 6, 16, 33, 100])
@pytest.mark.parametrize("in_features, out_features", [(576, 960), (1536, 130), (40, 7), (21, 3)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_kernel_is_f_linear_over_the_widened_weight(tokens, in_features, out_features, with_bias):
    gen = torch.Generator().manual_seed(tokens * 1000 + in_features + out_features)
    x = torch.randn(tokens, in_features, generator=gen)
    weight = (torch.randn(out_features, in_features, generator=gen) / in_features**0.5).to(torch.bfloat16)
    bias = torch.randn(out_features, generator=gen) if with_bias else None
    out = torch.full((tokens, out_features), float("nan"))
    torch.ops.s3_cpu.bf16_weight_linear(out, x, cpu_kernels.bf16_weight_pack(weight), bias)
    # fp32 sums of exact products (a bf16 times an fp32 is exact in fp32's arithmetic up to its rounding), in
    # another order than F.linear's
    torch.testing.assert_close(out, F.linear(x, weight.float(), bias), atol=1e-5, rtol=1e-5)


def test_packing_lays_out_16_column_panels_interleaved_and_padded():
    weight = torch.arange(20 * 3, dtype=torch.float32).reshape(20, 3)  # bf16 holds these integers exactly
    packed = cpu_kernels.bf16_weight_pack(weight)
    assert packed.shape == (2, 3, 16) and packed.dtype == torch.bfloat16
    # panel 0, k 1: columns 0, 8, 1, 9, ..., 7, 15 of row k
    assert packed[0, 1].tolist() == [weight[c, 1].item() for pair in zip(range(8), range(8, 16)) for c in pair]
    # panel 1 holds columns 16-19, then zeros: 16, pad, 17, pad, ...
    assert packed[1, 0, :8].tolist() == [48.0, 0.0, 51.0, 0.0, 54.0, 0.0, 57.0, 0.0]
    assert not packed[1, :, 8:].any()


def test_the_kernel_refuses_other_dtypes_and_shapes_and_names_them():
    x, out = torch.zeros(2, 16), torch.zeros(2, 4)
    packed = cpu_kernels.bf16_weight_pack(torch.zeros(4, 16))
    with pytest.raises(RuntimeError, match="fp32 x and out and a bf16 packed weight"):
        torch.ops.s3_cpu.bf16_weight_linear(out, x, packed.float(), None)
    with pytest.raises(RuntimeError, match=r"packed weight must be \[1, 8, 16\] for x \[M, 8\] and out \[M, 4\]"):
        torch.ops.s3_cpu.bf16_weight_linear(out, torch.zeros(2, 8), packed, None)
    with pytest.raises(RuntimeError, match=r"packed weight must be \[2, 16, 16\]"):
        torch.ops.s3_cpu.bf16_weight_linear(torch.zeros(2, 20), x, packed, None)
    with pytest.raises(RuntimeError, match="2-D x and out and a packed weight"):
        torch.ops.s3_cpu.bf16_weight_linear(out, x, torch.zeros(4, 16, dtype=torch.bfloat16), None)
    with pytest.raises(RuntimeError, match=r"bias must be a contiguous fp32 \[4\]"):
        torch.ops.s3_cpu.bf16_weight_linear(out, x, packed, torch.zeros(4, dtype=torch.bfloat16))
    assert not out.any()


def test_the_kernel_says_whether_it_was_built_for_avx2_lanes():
    # built for this CPU (-march=native; for `pytest --cpu-kind`, its kind's level): AVX2 lanes on an AVX2-only kind
    assert torch.ops.s3_cpu.bf16_weight_linear_native() == cpu_kind.this_cpu().widens_bf16_weights


@pytest.mark.parametrize("kind, widens", [("avx2", True), ("avx512", False), ("avx512_bf16", False), ("amx", False),
                                          ("baseline", False)])
def test_auto_means_bf16_weights_only_on_a_cpu_without_bf16_whose_kernels_widen_them(fake_cpu, kind, widens):
    fake_cpu(kind, runs_kernels=False)
    assert reads_bf16_weights("auto", "cpu") == widens
    assert not reads_bf16_weights("float32", "cpu")  # asked for fp32 weights
    assert not reads_bf16_weights("auto", "meta")  # not the CPU


def test_avx2_without_fma_or_with_avx512_is_no_widening_cpu():
    assert not cpu_kind.CpuKind(frozenset({"avx2"})).widens_bf16_weights
    assert not cpu_kind.CpuKind(frozenset({"avx2", "fma", "avx512f"})).widens_bf16_weights
    assert not cpu_kind.CpuKind(frozenset({"avx2", "fma", "avx512_bf16"})).widens_bf16_weights


def test_rounding_keeps_fp32_tensors_holding_bf16_values_and_refuses_a_half_model():
    model = make_tiny_model(seed=4, init_std=0.2)
    before = model.model.layers[0].mlp.down_proj.weight.clone()
    norm = model.model.layers[0].input_layernorm.weight.clone()
    assert round_linear_weights_to_bf16(model) is model and has_bf16_linear_weights(model)
    after = model.model.layers[0].mlp.down_proj.weight
    assert after.dtype == torch.float32 and torch.equal(after, before.to(torch.bfloat16).float())
    assert not torch.equal(after, before)
    assert torch.equal(model.model.layers[0].input_layernorm.weight, norm)  # norms are no linears
    assert not has_bf16_linear_weights(make_tiny_model(seed=4))
    with pytest.raises(ValueError, match="for an fp32 model, got torch.bfloat16"):
        round_linear_weights_to_bf16(make_tiny_model(seed=4).to(torch.bfloat16))


def test_the_benches_and_the_labeller_get_the_weights_a_worker_serves_where_auto_rounds_them(fake_cpu, monkeypatch):
    from benchmarks.sim_calibration import calibration_model

    fake_cpu("avx2", runs_kernels=False)
    assert not has_bf16_linear_weights(linear_weights.as_served(make_tiny_model(seed=4), "cpu", "float32"))
    model = make_tiny_model(seed=4, init_std=0.2)
    before = model.lm_head.weight.clone()
    assert linear_weights.as_served(model) is model and has_bf16_linear_weights(model)
    assert torch.equal(model.lm_head.weight, before.to(torch.bfloat16).float())
    assert linear_weights.as_served(model) is model  # once only: already rounded
    elsewhere = make_tiny_model(seed=4, init_std=0.2)
    assert not has_bf16_linear_weights(linear_weights.as_served(elsewhere, "meta"))  # auto keeps fp32 there
    assert not has_bf16_linear_weights(linear_weights.as_served(make_tiny_model(seed=4).to(torch.bfloat16)))
    monkeypatch.setattr("workers.engine.models.load_model", lambda model_dir: make_tiny_model(seed=4))
    assert has_bf16_linear_weights(calibration_model("cpu", "tiny", None, 0, 64))
    labels = [linear_weights.precision_label(d, w) for d, w in
              ((torch.bfloat16, False), (torch.float32, True), (torch.float32, False))]
    assert labels == ["bf16", "fp32+bf16w", "fp32"]


def test_a_worker_rounds_its_weights_where_auto_means_bf16_weights_and_the_fast_path_reads_them(fake_cpu,
                                                                                                 monkeypatch):
    from workers.actors.worker_actor import load_worker_model, worker_kv_bytes
    from workers.actors.worker_settings import WorkerSettings

    fake_cpu("avx2", runs_kernels=False)  # an AVX2-only CPU, whatever this one is

    def load(**changes):
        return load_worker_model(WorkerSettings.of(tiny_model_seed=0, device="cpu", **changes))[0]

    model = load(dtype="auto")
    assert has_bf16_linear_weights(model) and model.dtype == torch.float32
    linear_elements = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert bf16_copy_bytes(model) == 2 * linear_elements
    assert not has_bf16_linear_weights(load(dtype="float32"))
    assert not has_bf16_linear_weights(load(dtype="auto", use_fast_path=False))  # the HF stack keeps fp32
    plain = load(dtype="float32")
    assert bf16_copy_bytes(plain) == 0
    # the KV budget leaves the copies' memory out of what it shares (a share of the memory free once loaded)
    settings = WorkerSettings.of(tiny_model_seed=0, device="cpu", kv_cache_memory="0.5")
    monkeypatch.setattr("workers.actors.worker_actor.free_memory_bytes", lambda device: 2**30)
    assert worker_kv_bytes(settings, plain, "cpu") - worker_kv_bytes(settings, model, "cpu") in range(
        linear_elements - 1, linear_elements + 2)  # a half share of 2 bytes per weight, rounding aside
