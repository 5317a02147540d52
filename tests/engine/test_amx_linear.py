"""`s3_cpu.amx_linear`, the AMX-tile bf16 linear for decode batches, against fp32 arithmetic rounded once; and the
tile layout `amx_pack` writes."""

import pytest
import torch

from kv_kernels import cpu_build, cpu_kernels
from test_small_linear import _reference  # fp32 sums of the bf16 products, rounded once
from workers.engine import cpu_kind

cpu_build.load()  # a failed build fails these tests (no skip): the engine's CPU path needs it

NATIVE = bool(torch.ops.s3_cpu.amx_linear_native())
_MISSING = " ".join(cpu_kind.this_cpu().missing_for(cpu_kind.KINDS["amx"])) or "the tile state from Linux (5.16 on)"
needs_amx = pytest.mark.skipif(not NATIVE, reason=f"needs {_MISSING}: the kernel is never called here "
                               "(test_the_kernel_says_whether_it_can_run checks that)")


def test_the_kernel_says_whether_it_can_run():
    # built with -march=native: the tiles exist where the CPU has them, and Linux (5.16 on) grants their state
    assert NATIVE == cpu_kind.this_cpu().has_amx


def test_the_tile_layout_holds_each_weight_once_as_tdpbf16ps_reads_it():
    weight = torch.randn(70, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)  # [N=70, K=64]
    packed = cpu_kernels.amx_pack(weight)  # [2 groups, 2 slices, 4 tiles, 16 rows, 32]
    assert packed.shape == (2, 2, 4, 16, 32)
    want = torch.zeros(2, 2, 4, 16, 32, dtype=torch.bfloat16)  # columns 70-127: zeros
    for n in range(70):
        for k in range(64):  # tile row r of a slice: the pair (2r, 2r + 1) of each of its 16 columns
            want[n // 64, k // 32, n % 64 // 16, k % 32 // 2, 2 * (n % 16) + k % 2] = weight[n, k]
    assert torch.equal(packed, want)


def test_amx_pack_refuses_what_the_tiles_cannot_take():
    with pytest.raises(ValueError, match="multiple of 32"):
        cpu_kernels.amx_pack(torch.zeros(8, 40, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bf16"):
        cpu_kernels.amx_pack(torch.zeros(8, 64))


# M: inside one 16-row block, whole blocks and a block's tail; N: whole 64-column groups and leftovers
@needs_amx
@pytest.mark.parametrize("tokens", [1, 2, 7, 16, 17, 31, 32, 33])
@pytest.mark.parametrize("in_features, out_features", [(576, 960), (64, 7), (1536, 130), (32, 1)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_amx_linear_is_the_fp32_sum_rounded_once(tokens, in_features, out_features, with_bias):
    gen = torch.Generator().manual_seed(tokens * 1000 + in_features + out_features)
    x = torch.randn(tokens, in_features, generator=gen).to(torch.bfloat16)
    weight = (torch.randn(out_features, in_features, generator=gen) / in_features**0.5).to(torch.bfloat16)
    bias = torch.randn(out_features, generator=gen).to(torch.bfloat16) if with_bias else None
    out = torch.full((tokens, out_features), float("nan"), dtype=torch.bfloat16)
    torch.ops.s3_cpu.amx_linear(out, x, cpu_kernels.amx_pack(weight), bias)
    # the sums differ from the reference's only in order (fp32): at most one bf16 step apart
    torch.testing.assert_close(out.float(), _reference(x, weight, bias).float(), atol=2e-2, rtol=2**-7)


@needs_amx
def test_amx_linear_refuses_what_it_cannot_compute():
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    packed = cpu_kernels.amx_pack(torch.zeros(8, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="contiguous"):
        strided = torch.zeros(2, 128, dtype=torch.bfloat16)[:, :64]  # rows 128 apart
        torch.ops.s3_cpu.amx_linear(torch.empty(2, 8, dtype=torch.bfloat16), strided, packed, None)
    with pytest.raises(RuntimeError, match="bf16"):
        torch.ops.s3_cpu.amx_linear(torch.empty(2, 8), x.float(), packed, None)
    with pytest.raises(RuntimeError, match=r"amx_pack of a \[100, 64\] weight"):
        torch.ops.s3_cpu.amx_linear(torch.empty(2, 100, dtype=torch.bfloat16), x, packed, None)
    with pytest.raises(RuntimeError, match=r"amx_pack of a \[8, 96\] weight"):
        torch.ops.s3_cpu.amx_linear(torch.empty(2, 8, dtype=torch.bfloat16), torch.zeros(2, 96, dtype=torch.bfloat16),
                                    packed, None)
    with pytest.raises(RuntimeError, match="2 rows"):
        torch.ops.s3_cpu.amx_linear(torch.empty(3, 8, dtype=torch.bfloat16), x, packed, None)
    with pytest.raises(RuntimeError, match=r"bias must be a contiguous bf16 \[8\]"):
        torch.ops.s3_cpu.amx_linear(torch.empty(2, 8, dtype=torch.bfloat16), x, packed,
                                    torch.zeros(9, dtype=torch.bfloat16))


@needs_amx
def test_amx_linear_takes_an_empty_batch():
    packed = cpu_kernels.amx_pack(torch.ones(8, 64, dtype=torch.bfloat16))
    out = torch.empty(0, 8, dtype=torch.bfloat16)
    torch.ops.s3_cpu.amx_linear(out, torch.empty(0, 64, dtype=torch.bfloat16), packed, None)
    assert out.shape == (0, 8)
