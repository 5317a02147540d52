"""`s3_cpu.decoder_layer` (`workers.engine.fused_layers`): a CPU step's layers in one C++ op each, against the same
decoder's Python layer loop over the same paged KV: the same logits and the same pool, bit for bit."""

import copy

import pytest
import torch

from engine_driver import ARCHITECTURES, tiny_architecture
from kv_kernels import build_attention_metadata, cpu_build
from kv_kernels.backend import CpuKVKernels, TorchKVKernels
from kv_kernels.layout import BlockPoolShape
from workers.engine import fused_layers
from workers.engine.attention import StepAttention
from workers.engine.fast_decoder import FastDecoder
from workers.engine.linear_weights import round_linear_weights_to_bf16
from workers.engine.models import make_tiny_model

cpu_build.load()  # a failed build fails these tests (no skip): the engine's CPU path needs it
# Every test runs as on an AVX2-only CPU (`fake_cpu`), the kind whose fp32 engine reads bf16 weights and fuses its
# layers; this machine's build runs the op (on AVX2 lanes where it is of that kind, or under `pytest --cpu-kind avx2`)
pytestmark = pytest.mark.usefixtures("avx2_cpu")
FUSED = {"llama", "mistral", "qwen2", "phi3"}  # Llama's layer; Qwen3's head norms and Gemma's are not
BLOCK = 4


@pytest.fixture
def avx2_cpu(fake_cpu):
    return fake_cpu("avx2")


def _step(fast: FastDecoder, backend, query_lens: list[int], seq_lens: list[int], num_prefills: int, seed: int):
    """A ragged step (prefill chunks first, then decodes) over a pool whose cached prefixes are random values,
    each sequence in blocks of its own: (input_ids, positions, StepAttention)."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-s // BLOCK) for s in seq_lens)
    pool = BlockPoolShape(len(fast.layers), num_blocks, BLOCK, fast.num_kv_heads, fast.head_dim, torch.float32)
    caches = [tuple(torch.randn(num_blocks, BLOCK, fast.num_kv_heads, fast.head_dim, generator=gen)
                    for _ in range(2)) for _ in fast.layers]
    tables, positions, slots, first = [], [], [], 0
    for query_len, seq_len in zip(query_lens, seq_lens):
        table = list(range(first, first + -(-seq_len // BLOCK)))
        first += len(table)
        tables.append(table)
        for position in range(seq_len - query_len, seq_len):
            positions.append(position)
            slots.append(table[position // BLOCK] * BLOCK + position % BLOCK)
    meta = build_attention_metadata(query_lens, seq_lens, tables, slots, num_prefills, pool, "cpu")
    ids = torch.randint(3, 200, (len(positions),), generator=gen)
    return ids, torch.tensor(positions), StepAttention(caches, backend, meta)


def _forward(fast: FastDecoder, ids, positions, step: StepAttention, fused: bool):
    fast.fused_layers = fused and fused_layers.fuses_layers(fast)
    rows = torch.arange(ids.shape[0])
    return fast.forward(ids, positions, lambda i, q, k, v, w: step(i, q, k, v, fast.scale, w), rows, step)


def _tiny(name: str) -> torch.nn.Module:
    return make_tiny_model(seed=3, init_std=0.2) if name == "llama" else tiny_architecture(name)


@pytest.mark.parametrize("name", sorted(set(ARCHITECTURES) - FUSED))
def test_layers_of_another_shape_run_the_python_loop(name):
    assert not FastDecoder(round_linear_weights_to_bf16(_tiny(name)), max_positions=64).fused_layers


@pytest.mark.parametrize("name", sorted(FUSED))
def test_fused_layers_give_the_python_loops_logits_and_pool_bit_for_bit(name):
    fast = FastDecoder(round_linear_weights_to_bf16(_tiny(name)), max_positions=64)
    assert fast.fused_layers
    # two prefill chunks (one after a cached prefix) and three decodes, one past a sliding window's keys
    shape = ([5, 3, 1, 1, 1], [8, 3, 9, 40, 4], 2)
    ids, positions, fused_step = _step(fast, CpuKVKernels(), *shape, seed=1)
    python_step = StepAttention(copy.deepcopy(fused_step.kv_caches), fused_step.backend, fused_step.meta)
    fused_logits, fused_hidden = _forward(fast, ids, positions, fused_step, fused=True)
    python_logits, python_hidden = _forward(fast, ids, positions, python_step, fused=False)
    assert torch.equal(fused_logits, python_logits) and torch.equal(fused_hidden, python_hidden)
    for (k_fused, v_fused), (k_python, v_python) in zip(fused_step.kv_caches, python_step.kv_caches):
        assert torch.equal(k_fused, k_python) and torch.equal(v_fused, v_python)  # the step's K/V appended alike
    assert fused_step.elapsed_s > 0  # attention's time, measured inside the op, reaches the step profile


@pytest.mark.parametrize("kind", ["avx512", "avx512_bf16", "amx", "baseline"])
def test_no_other_kind_fuses_its_layers(fake_cpu, kind):
    fake_cpu(kind, runs_kernels=False)  # FastDecoder only decides here: fp32 over bf16 weights is no kind's but AVX2's
    fast = FastDecoder(round_linear_weights_to_bf16(_tiny("llama")), max_positions=64)
    assert not fast.reads_bf16_weights and not fast.fused_layers


def test_a_step_runs_fused_only_on_the_cpu_backend_and_within_the_linear_kernels_tokens():
    fast = FastDecoder(round_linear_weights_to_bf16(_tiny("llama")), max_positions=64)
    ids, positions, step = _step(fast, CpuKVKernels(), [1, 1], [5, 9], 0, seed=2)
    assert fused_layers.serves_step(fast, 2, step)
    assert not fused_layers.serves_step(fast, 2, None)  # a caller with its own attention function
    assert not fused_layers.serves_step(fast, fast.lm_head.few_token_max + 1, step)  # F.linear's tokens
    torch_step = StepAttention(step.kv_caches, TorchKVKernels(), step.meta)
    assert not fused_layers.serves_step(fast, 2, torch_step)  # the reference backend: the Python loop
