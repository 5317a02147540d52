"""`s3_cpu.small_linear`, the few-token bf16 linear, against fp32 arithmetic rounded once; and the fast path's use."""

import copy

import pytest
import torch

from kv_kernels import cpu_build
from workers.engine import cpu_kind, fast_linear
from workers.engine.fast_decoder import FastDecoder
from workers.engine.fast_linear import FEW_TOKEN_KERNELS
from workers.engine.models import make_tiny_model

cpu_build.load()  # a failed build fails these tests (no skip): the engine's CPU path needs it


def _reference(x, weight, bias):
    out = x.float() @ weight.float().T  # [M, N] exact products of the bf16 values, fp32 sums
    return (out if bias is None else out + bias.float()).to(torch.bfloat16)


# K: whole 32-element slices and a masked tail; N: whole 8-row blocks and leftovers; M: 1, 2 and past a block
@pytest.mark.parametrize("tokens", [1, 2, 3, 4, 5, 8, 13])
@pytest.mark.parametrize("in_features, out_features", [(576, 960), (40, 7), (1536, 130), (96, 1)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_small_linear_is_the_fp32_sum_rounded_once(tokens, in_features, out_features, with_bias):
    gen = torch.Generator().manual_seed(tokens * 1000 + in_features + out_features)
    x = torch.randn(tokens, in_features, generator=gen).to(torch.bfloat16)
    weight = (torch.randn(out_features, in_features, generator=gen) / in_features**0.5).to(torch.bfloat16)
    bias = torch.randn(out_features, generator=gen).to(torch.bfloat16) if with_bias else None
    out = torch.empty(tokens, out_features, dtype=torch.bfloat16)
    torch.ops.s3_cpu.small_linear(out, x, weight, bias)
    want = _reference(x, weight, bias)
    # the sums differ from the reference's only in order (fp32): at most one bf16 step apart
    torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2**-7)


def test_the_kernel_says_whether_it_was_built_for_the_cpus_bf16_dots():
    # built with -march=native: never native where the CPU lacks the instructions; here gcc >= 11 has them
    assert torch.ops.s3_cpu.small_linear_native() == ("avx512_bf16" in cpu_kind.this_cpu().flags)


def test_small_linear_refuses_what_it_cannot_compute():
    x = torch.zeros(2, 8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="contiguous"):
        strided = torch.zeros(2, 16, dtype=torch.bfloat16)[:, :8]  # rows 16 apart
        torch.ops.s3_cpu.small_linear(torch.empty(2, 4, dtype=torch.bfloat16), strided,
                                      torch.zeros(4, 8, dtype=torch.bfloat16), None)
    with pytest.raises(RuntimeError, match="bf16"):
        torch.ops.s3_cpu.small_linear(torch.empty(2, 4), x.float(), torch.zeros(4, 8), None)
    with pytest.raises(RuntimeError, match=r"weight must be \[N, 8\]"):
        torch.ops.s3_cpu.small_linear(torch.empty(2, 4, dtype=torch.bfloat16), x,
                                      torch.zeros(4, 9, dtype=torch.bfloat16), None)
    with pytest.raises(RuntimeError, match=r"out must be \[2, 4\]"):
        torch.ops.s3_cpu.small_linear(torch.empty(3, 4, dtype=torch.bfloat16), x,
                                      torch.zeros(4, 8, dtype=torch.bfloat16), None)


def _kinds_kernel(fake_cpu, kind: str) -> str:
    """The few-token kernel of a CPU of `kind`, faked; skips where this machine's build cannot run it."""
    fake_cpu(kind)
    name = cpu_kind.this_cpu().bf16_few_token_kernels[0]
    if fast_linear.few_token_kernel() != name:
        pytest.skip(f"needs {name} in the kernels' build (here: {', '.join(cpu_build.native_kernels()) or 'none'})")
    return name


@pytest.mark.parametrize("kind", ["amx", "avx512_bf16"])
def test_the_fast_path_takes_the_few_token_kernel_up_to_its_limit_and_onednn_past_it(fake_cpu, monkeypatch, kind):
    name = _kinds_kernel(fake_cpu, kind)
    limit = FEW_TOKEN_KERNELS[name]
    calls = []
    op = getattr(torch.ops.s3_cpu, name)

    def counted(out, x, weight, bias):
        calls.append(x.shape[0])
        op(out, x, weight, bias)

    monkeypatch.setattr(fast_linear.torch.ops.s3_cpu, name, counted)  # before the linears look their kernel up
    model = make_tiny_model(seed=5, init_std=0.2).to(torch.bfloat16)
    decoder = FastDecoder(copy.deepcopy(model), max_positions=64)
    assert decoder.few_token == name  # AMX tiles on an AMX CPU, vdpbf16ps on one with AVX512-BF16 alone
    weight = model.model.layers[0].self_attn.o_proj.weight  # [hidden, hidden]
    o_proj = decoder.layers[0].o_proj
    assert o_proj.few_token == name
    for tokens in sorted({1, limit, limit + 1}):
        x = torch.randn(tokens, weight.shape[1], generator=torch.Generator().manual_seed(tokens)).to(torch.bfloat16)
        torch.testing.assert_close(o_proj(x).float(), _reference(x, weight, None).float(), atol=2e-2, rtol=2**-7)
    assert calls == sorted({1, limit})  # past the limit, oneDNN's packed linear


@pytest.mark.parametrize("kind, kernel", [("amx", "amx_linear"), ("avx512_bf16", "small_linear"), ("avx512", None),
                                          ("avx2", None), ("baseline", None)])
def test_the_few_token_kernel_is_the_fastest_one_the_kind_has(fake_cpu, kind, kernel):
    fake_cpu(kind)
    assert fast_linear.few_token_kernel() == kernel
    # an input width the tiles cannot take: the next kernel down that the kind has
    assert fast_linear.few_token_kernel(below="amx_linear") == (
        "small_linear" if kind in ("amx", "avx512_bf16") else None)


@pytest.mark.parametrize("few_token", [None, "small_linear", "amx_linear"])
def test_a_linear_takes_an_empty_batch_with_or_without_a_few_token_kernel(few_token):
    built = cpu_build.native_kernels()
    if few_token is not None and few_token not in built:
        pytest.skip(f"needs {few_token} in the kernels' build (here: {', '.join(built) or 'none'})")
    weight = torch.randn(8, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with torch.no_grad():
        linear = fast_linear.Linear(weight, None, pack=fast_linear.onednn_packs_bf16(), few_token=few_token)
    assert linear(torch.empty(0, 64, dtype=torch.bfloat16)).shape == (0, 8)


def test_an_input_width_the_tiles_cannot_take_falls_back_to_the_one_token_kernel_or_onednn():
    weight = torch.randn(8, 40, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)  # 40: not 32k
    with torch.no_grad():
        linear = fast_linear.Linear(weight, None, pack=fast_linear.onednn_packs_bf16(), few_token="amx_linear")
    assert linear.few_token == ("small_linear" if "small_linear" in cpu_build.native_kernels() else None)
    x = torch.randn(1, 40, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    torch.testing.assert_close(linear(x).float(), _reference(x, weight, None).float(), atol=2e-2, rtol=2**-7)
