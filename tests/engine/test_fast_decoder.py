"""The fast path: its elementwise ops (the C++ CPU kernels and the torch ops CUDA runs) against Hugging Face's
own modules, FastDecoder against HF's forward (tiny random Llama, and each of the other architectures with the torch
ops CUDA runs), and the engine on the fast path against the engine on the HF module stack (tiny random Llama; the
other architectures against HF `generate` in test_architectures)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import Gemma3TextConfig, Phi3Config, Phi3ForCausalLM
from transformers.models.gemma3 import modeling_gemma3
from transformers.models.llama import modeling_llama

from engine_driver import ARCHITECTURES, SHAPE, tiny_architecture

from kv_kernels import cpu_build, cpu_kernels, torch_layer_ops
from workers.engine import cpu_kind
from workers.engine.engine import Engine, EngineConfig
from workers.engine.fast_decoder import FastDecoder, unsupported_reason
from workers.engine.fast_linear import few_token_kernel
from workers.engine.linear_weights import round_linear_weights_to_bf16
from workers.engine.models import make_tiny_model, tiny_llama_config
from workers.values.sampling_params import SamplingParams

cpu_build.load()

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
OPS = pytest.mark.parametrize("ops", [cpu_kernels, torch_layer_ops], ids=["cpu_kernels", "torch_ops"])
# One bf16 unit in the last place at magnitude ~1: sums of squares are added in another
# order than torch's, which can move a rounding by one ulp.
BF16_ULP = 2**-7


def assert_bf16_as_close_as_hf(got: torch.Tensor, want: torch.Tensor, exact: torch.Tensor) -> None:
    """bf16 logits `got` against `exact`, the fp32 forward of the same bf16-rounded weights: no further from it than
    twice Hugging Face's own bf16 forward (`want`) is, and the same top token wherever fp32's top two are further
    apart than those errors could move them (an independent reference, not a share of the largest logit)."""
    got, want, exact = got.float(), want.float(), exact.float()
    own, ours = (want - exact).abs().max().item(), (got - exact).abs().max().item()
    assert ours <= 2 * own + 1e-6, f"max error {ours:.5f} against fp32; Hugging Face's bf16 forward: {own:.5f}"
    top_two = exact.topk(2, dim=-1).values
    clear = (top_two[:, 0] - top_two[:, 1]) > 2 * (ours + own)
    assert torch.equal(got.argmax(-1)[clear], exact.argmax(-1)[clear])


def fp32_logits(model, prompt: torch.Tensor) -> torch.Tensor:
    """The fp32 forward of `model`'s weights as they are (bf16-rounded ones included): [T, V]."""
    with torch.inference_mode():
        return copy.deepcopy(model).float()(prompt[None]).logits[0].float()


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(got.float(), want.float(), atol=BF16_ULP, rtol=BF16_ULP)


@OPS
@DTYPES
def test_rms_norm_and_fused_add_match_llama_rms_norm(dtype, ops):
    gen = torch.Generator().manual_seed(0)
    norm = modeling_llama.LlamaRMSNorm(96, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96, generator=gen))
    norm = norm.to(dtype)
    x = torch.randn(7, 96, generator=gen).to(dtype)
    residual = torch.randn(7, 96, generator=gen).to(dtype)
    with torch.no_grad():
        _close(ops.rms_norm(x, norm.weight, 1e-6), norm(x), dtype)
        summed = residual + x
        fused_x, fused_residual = x.clone(), residual.clone()
        ops.fused_add_rms_norm(fused_x, fused_residual, norm.weight, 1e-6)
        assert torch.equal(fused_residual, summed)  # the add rounds exactly as HF's does
        _close(fused_x, norm(summed), dtype)
        if ops is torch_layer_ops:  # HF's own ops in HF's order: the same bits
            assert torch.equal(fused_x, norm(summed))


@OPS
@DTYPES
def test_a_float32_weight_norms_as_gemma3_rms_norm_does(dtype, ops):
    """Gemma3RMSNorm multiplies by (1 + w) in float32 and rounds once; the ops do that given the float32 weight."""
    gen = torch.Generator().manual_seed(7)
    norm = modeling_gemma3.Gemma3RMSNorm(128, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(128, generator=gen) * 0.5)
    norm = norm.to(dtype)
    weight = 1.0 + norm.weight.float()
    x = (torch.randn(9, 128, generator=gen) * 3).to(dtype)
    residual = torch.randn(9, 128, generator=gen).to(dtype)
    with torch.no_grad():
        _close(ops.rms_norm(x, weight, 1e-6), norm(x), dtype)
        fused_x, fused_residual = x.clone(), residual.clone()
        ops.fused_add_rms_norm(fused_x, fused_residual, weight, 1e-6)
        assert torch.equal(fused_residual, residual + x)
        _close(fused_x, norm(residual + x), dtype)
    if dtype == torch.bfloat16:  # the Llama rounding (normed rounded before the weight) is measurably different
        llama_way = ops.rms_norm(x, weight.to(dtype), 1e-6)
        assert not torch.equal(llama_way, ops.rms_norm(x, weight, 1e-6))


@OPS
@DTYPES
def test_rotary_matches_apply_rotary_pos_emb_on_strided_qkv_slices(dtype, ops):
    model = make_tiny_model(seed=1).to(dtype)
    fast = FastDecoder(model, max_positions=64)
    head_dim, num_heads, num_kv_heads = fast.head_dim, fast.num_heads, fast.num_kv_heads
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(5, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype)
    positions = torch.tensor([0, 3, 17, 40, 63])
    q, k = qkv[:, : num_heads * head_dim], qkv[:, num_heads * head_dim: (num_heads + num_kv_heads) * head_dim]
    cos, sin = model.model.rotary_emb(qkv, positions[None])  # [1, T, D] each
    want_q, want_k = modeling_llama.apply_rotary_pos_emb(
        q.reshape(1, 5, num_heads, head_dim).transpose(1, 2), k.reshape(1, 5, num_kv_heads, head_dim).transpose(1, 2),
        cos, sin)
    ops.rotary_embedding(positions, q, k, fast.cos_sin[0], head_dim)  # in place on the views
    _close(q.reshape(5, num_heads, head_dim), want_q[0].transpose(0, 1), dtype)
    _close(k.reshape(5, num_kv_heads, head_dim), want_k[0].transpose(0, 1), dtype)


@pytest.mark.parametrize("bad", [64, -1])
def test_the_cpu_rotary_refuses_a_position_outside_its_table_and_names_it(bad):
    cos_sin = torch.zeros(64, 16)  # positions 0-63
    q, k = torch.zeros(3, 32), torch.zeros(3, 16)
    with pytest.raises(RuntimeError, match=rf"positions \[{min(bad, 0)}, {max(bad, 63)}\] outside the rotary table"):
        cpu_kernels.rotary_embedding(torch.tensor([63, bad, 0]), q, k, cos_sin, 16)
    assert not q.any() and not k.any()  # nothing rotated


@OPS
@DTYPES
def test_silu_and_mul_matches_llama_mlp_activation(dtype, ops):
    width = 43  # vectors of 8 and 16 lanes, then a scalar tail
    gate_up = (torch.randn(6, 2 * width, generator=torch.Generator().manual_seed(2)) * 4).to(dtype)
    want = F.silu(gate_up[:, :width]) * gate_up[:, width:]
    _close(ops.silu_and_mul(gate_up), want, dtype)


@DTYPES
def test_fast_forward_with_the_torch_ops_matches_the_hf_forward(dtype):
    """What CUDA runs (torch's ops, one GEMM for q|k|v and one for gate|up), checked here on the CPU."""
    model = make_tiny_model(seed=3, init_std=0.2).to(dtype)
    fast = FastDecoder(model, max_positions=64, ops=torch_layer_ops)
    assert fast.ops is torch_layer_ops
    prompt = torch.randint(3, 256, (37,), generator=torch.Generator().manual_seed(3))
    num_heads, head_dim = fast.num_heads, fast.head_dim
    with torch.inference_mode():
        want = model(prompt[None]).logits[0].float()  # [T, V]
        got, _ = fast.forward(prompt, torch.arange(37), _windowed_causal(fast), torch.arange(37))
    assert got.shape == (37, model.config.vocab_size) and head_dim * num_heads == model.config.hidden_size
    if dtype == torch.float32:
        torch.testing.assert_close(got.float(), want, atol=1e-4, rtol=1e-4)
    else:
        assert_bf16_as_close_as_hf(got, want, fp32_logits(model, prompt))


@pytest.mark.parametrize("kind", ["amx", "avx512_bf16"])
@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_each_architecture_forwards_as_hugging_face_with_the_few_token_kernel_in_bf16(fake_cpu, name, kind):
    """What a CPU decode step of up to 32 sequences runs: every linear through its kind's few-token kernel."""
    fake_cpu(kind)
    want_kernel = cpu_kind.this_cpu().bf16_few_token_kernels[0]
    if few_token_kernel() != want_kernel:
        pytest.skip(f"needs {want_kernel} in the kernels' build ({', '.join(cpu_build.native_kernels()) or 'none'})")
    model = tiny_architecture(name).to(torch.bfloat16)
    fast = FastDecoder(model, max_positions=64)
    assert fast.few_token == want_kernel
    tokens = 24 if fast.few_token == "amx_linear" else 1  # within the kernel's limit (FEW_TOKEN_KERNELS)
    prompt = torch.randint(3, 256, (tokens,), generator=torch.Generator().manual_seed(9))
    with torch.inference_mode():
        want = model(prompt[None]).logits[0].float()  # [T, V]
        got, _ = fast.forward(prompt, torch.arange(tokens), _windowed_causal(fast), torch.arange(tokens))
    assert_bf16_as_close_as_hf(got, want, fp32_logits(model, prompt))


@pytest.mark.parametrize("kind", ["avx2", "avx512"])
@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_each_architecture_forwards_as_hugging_face_in_fp32_over_bf16_linear_weights(fake_cpu, name, kind):
    """dtype auto on an AVX2-only CPU: the weights rounded to bf16 in the model, the fast path reading a bf16 copy
    and computing in fp32, at 1 token and at 37; a CPU of another kind given such a model reads it with F.linear."""
    fake_cpu(kind)
    model = round_linear_weights_to_bf16(tiny_architecture(name))
    fast = FastDecoder(model, max_positions=64)
    assert fast.reads_bf16_weights == (kind == "avx2")
    assert all(param.dtype == torch.float32 for param in model.parameters())
    linears = [fast.lm_head, *(linear for layer in fast.layers for linear in (*layer.qkv, layer.o_proj))]
    if kind == "avx2":
        assert {(linear.few_token, linear.few_weight.dtype) for linear in linears} == {
            ("bf16_weight_linear", torch.bfloat16)}
        # the packed copies live in the decoder's huge-page arena
        assert fast.arena.bytes_mapped >= sum(linear.few_weight.numel() * 2 for linear in linears)
        assert len(fast.layers[0].qkv) == 1  # q|k|v in one call, or Phi-3's own fused weight
    else:
        assert {linear.few_token for linear in linears} == {None} and fast.arena is None
    for tokens in (1, 37):
        prompt = torch.randint(3, 256, (tokens,), generator=torch.Generator().manual_seed(10))
        with torch.inference_mode():
            want = model(prompt[None]).logits[0]  # [T, V], HF's fp32 forward over the same bf16 values
            got, _ = fast.forward(prompt, torch.arange(tokens), _windowed_causal(fast), torch.arange(tokens))
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def _windowed_causal(fast: FastDecoder):
    """Plain causal attention over one sequence, within `window` keys when > 0: the reference for a forward."""
    def attend(index, q, k, v, window):  # q [T, H, D], k and v [T, KVH, D] -> [T, H, D]
        group = fast.num_heads // fast.num_kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        rows, cols = torch.arange(q.shape[0])[:, None], torch.arange(q.shape[0])[None]
        allowed = (cols <= rows) & ((cols > rows - window) if window else True)  # [T, T]
        return F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                              attn_mask=allowed, scale=fast.scale).transpose(0, 1).contiguous()
    return attend


@DTYPES
@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_each_architecture_forwards_as_hugging_face_with_the_torch_ops(name, dtype):
    """What CUDA runs for every architecture, checked on the CPU: 37 tokens, past the tiny models' 8-token window."""
    model = tiny_architecture(name).to(dtype)
    fast = FastDecoder(model, max_positions=64, ops=torch_layer_ops)
    prompt = torch.randint(3, 256, (37,), generator=torch.Generator().manual_seed(8))
    with torch.inference_mode():
        want = model(prompt[None]).logits[0].float()  # [T, V]
        got, _ = fast.forward(prompt, torch.arange(37), _windowed_causal(fast), torch.arange(37))
    if dtype == torch.float32:
        torch.testing.assert_close(got.float(), want, atol=1e-4, rtol=1e-4)
    else:
        assert_bf16_as_close_as_hf(got, want, fp32_logits(model, prompt))


def _engine(model, use_fast_path: bool, **config) -> Engine:
    fields = dict(kv_cache_bytes=256 * 2 * 2 * 16 * 2 * 16 * 4, block_size=16, max_num_seqs=4,
                  max_num_batched_tokens=24, max_model_len=256)
    fields.update(config)
    return Engine(copy.deepcopy(model), EngineConfig.of(use_fast_path=use_fast_path, **fields))


@DTYPES
def test_fast_forward_matches_the_hf_forward(dtype, prefill_logits):
    model = make_tiny_model(seed=3, init_std=0.2).to(dtype)
    prompt = torch.randint(3, 256, (37,), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        want = model(prompt[None]).logits[0].float()  # [T, V], HF's own eager forward
    got = prefill_logits(_engine(model, use_fast_path=True, max_num_batched_tokens=64), prompt.tolist())
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    else:
        assert_bf16_as_close_as_hf(got, want, fp32_logits(model, prompt))  # bf16: each op rounds


@pytest.mark.parametrize("kv_blocks", [256, 5], ids=["ample", "preempting"])
def test_fast_and_hf_paths_generate_the_same_greedy_tokens(kv_blocks):
    model = make_tiny_model(seed=4, init_std=0.2)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (5, 30, 17, 50, 9)]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (20, 12, 25, 8, 30)]
    bytes_per_block = 2 * 2 * 16 * 2 * 16 * 4  # layers x K,V x block_size x kv_heads x head_dim x fp32
    outputs = {}
    for fast in (True, False):
        engine = _engine(model, use_fast_path=fast, kv_cache_bytes=kv_blocks * bytes_per_block)
        assert engine.runner.path == ("fast" if fast else "hf")
        outputs[fast] = engine.generate(prompts, params)
        if kv_blocks == 5:
            assert engine.scheduler.stats.num_preemptions > 0
    assert outputs[True] == outputs[False]


def test_a_model_with_one_kv_head_generates_the_same_on_both_paths():
    # Multi-query attention (or one tensor-parallel rank's share of the KV heads): a single KV head.
    config = tiny_llama_config()
    config.num_key_value_heads = 1
    torch.manual_seed(6)
    model = modeling_llama.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.2)
    prompts = [[5, 9, 3, 7, 11], list(range(3, 40))]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    bytes_per_block = 2 * 2 * 16 * 1 * 16 * 4  # layers x K,V x block_size x kv_heads x head_dim x fp32
    outputs = [_engine(model, use_fast_path=fast, kv_cache_bytes=64 * bytes_per_block).generate(prompts, params)
               for fast in (True, False)]
    assert outputs[0] == outputs[1]


def test_models_the_fast_path_cannot_run_take_the_hf_path():
    config = tiny_llama_config()
    config.rope_parameters = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    model = modeling_llama.LlamaForCausalLM(config).eval()
    assert "dynamic" in unsupported_reason(model)
    engine = _engine(model, use_fast_path=True)
    assert engine.runner.path == "hf" and "dynamic" in engine.runner.fast_path_off_reason
    with pytest.raises(ValueError, match="FastDecoder cannot run this model: rope_type 'dynamic'"):
        FastDecoder(model, 64)


def test_what_the_fast_path_does_not_compute_is_named():
    phi3 = Phi3ForCausalLM(Phi3Config(**SHAPE, pad_token_id=0, partial_rotary_factor=0.5)).eval()
    assert unsupported_reason(phi3) == "partial rotary embedding (8 of 16 dims)"
    gemma = modeling_gemma3.Gemma3ForCausalLM(Gemma3TextConfig(**SHAPE, head_dim=16, pad_token_id=0,
                                                               final_logit_softcapping=30.0)).eval()
    assert unsupported_reason(gemma) == "final logit softcapping"
    config = tiny_llama_config()
    config.hidden_act = "relu"
    assert "activation 'relu'" in unsupported_reason(modeling_llama.LlamaForCausalLM(config))
    for name in ARCHITECTURES:
        assert unsupported_reason(tiny_architecture(name)) is None, name
