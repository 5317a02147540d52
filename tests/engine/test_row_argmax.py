"""`s3_cpu.row_argmax`, greedy decoding's pick, against torch.max; and the engine's sampler taking it."""

import pytest
import torch

from kv_kernels import cpu_build
from kv_kernels.backend import CpuKVKernels, TorchKVKernels
from workers.engine.sampling import Sampler
from workers.values.sampling_params import SamplingParams

cpu_build.load()  # a failed build fails these tests (no skip): the engine's CPU path needs it

NAN, INF = float("nan"), float("inf")


def _expected(logits: torch.Tensor) -> torch.Tensor:
    return torch.max(logits, dim=-1).indices


# vocabularies: below one 16-lane vector, whole vectors, a tail; SmolLM2's
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows, vocab", [(1, 1), (3, 15), (5, 16), (4, 33), (9, 1000), (7, 49152)])
def test_the_kernel_picks_what_torch_max_picks(dtype, rows, vocab):
    gen = torch.Generator().manual_seed(rows * vocab)
    logits = torch.randn(rows, vocab, generator=gen).to(dtype)
    assert torch.equal(torch.ops.s3_cpu.row_argmax(logits), _expected(logits))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ties_take_the_first_maximum_and_a_nan_wins_wherever_it_is(dtype):
    vocab = 50  # three vectors and a tail of two
    logits = torch.zeros(8, vocab)
    logits[0, [7, 23, 40]] = 3.0  # ties in two lanes and two vectors: the first
    logits[1, [49, 48]] = 2.0  # ties in the tail
    logits[2, [17, 1]] = 2.0  # the later vector's lane index is the smaller: still the first position
    logits[3] = -INF  # nothing but -inf: the first
    logits[4, 30] = NAN  # a NaN in a vector
    logits[5, [49, 3]] = torch.tensor([NAN, 9.0])  # a NaN in the tail beats a larger number before it
    logits[6, [0, 20]] = NAN  # the first of two NaNs
    logits[7, 48] = 1.0  # the maximum in the tail
    logits = logits.to(dtype)
    picks = torch.ops.s3_cpu.row_argmax(logits)
    assert picks.tolist() == [7, 48, 1, 0, 30, 49, 0, 48]
    assert torch.equal(picks, _expected(logits))


def test_rows_may_be_a_strided_view_and_none_at_all():
    wide = torch.randn(6, 300).to(torch.bfloat16)
    view = wide[::2, 10:210]  # rows 600 elements apart, each contiguous
    assert torch.equal(torch.ops.s3_cpu.row_argmax(view), _expected(view))
    assert torch.ops.s3_cpu.row_argmax(torch.empty(0, 64)).shape == (0,)
    with pytest.raises(RuntimeError, match="contiguous rows"):
        torch.ops.s3_cpu.row_argmax(wide.T)
    with pytest.raises(RuntimeError, match=r"\[N, V\]"):
        torch.ops.s3_cpu.row_argmax(wide[0])


def test_the_cpu_backend_falls_back_to_torch_where_the_kernel_cannot_read_the_rows():
    logits = torch.randn(64, 5).to(torch.bfloat16).T  # [5, 64], columns 5 apart
    assert torch.equal(CpuKVKernels().row_argmax(logits), _expected(logits))
    assert torch.equal(TorchKVKernels().row_argmax(logits), _expected(logits))


def test_the_sampler_takes_greedy_rows_from_the_backends_argmax_and_samples_the_rest():
    calls = []

    def counted(logits):
        calls.append(tuple(logits.shape))
        return CpuKVKernels().row_argmax(logits)

    logits = torch.randn(3, 49152).to(torch.bfloat16)
    sampler = Sampler(row_argmax=counted)
    greedy, sampled = SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=5)
    picks = sampler.sample(logits, ["a", "b", "c"], [greedy, sampled, greedy])
    assert calls == [(3, 49152)]
    assert [picks[0], picks[2]] == _expected(logits)[[0, 2]].tolist()
    assert picks[1] == Sampler().sample(logits[1:2], ["b"], [sampled])[0]  # its seed's draw, as without the kernel
