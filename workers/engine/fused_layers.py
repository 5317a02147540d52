"""Each decoder layer of a CPU step in one C++ call (`s3_cpu.decoder_layer`, kv_kernels/csrc/decoder_layer.cpp).

The fast path's layer loop (`workers.engine.fast_decoder`) calls ~25 tensor ops per layer from Python, 2-4 us
each: at a few tokens that overhead is a sixth of a step on a 135M model. Where the layers have Llama's shape
and the fp32 engine reads bf16 weights (`s3_cpu.bf16_weight_linear`: AVX2-only CPUs, dtype auto), and the
step's attention is the C++ CPU backend's, one op per layer runs the same kernels in the same order from C++:
the results are the Python loop's, bit for bit.
"""

import torch

from workers.engine.attention import StepAttention


def fuses_layers(decoder) -> bool:
    """True when `decoder` (a FastDecoder) has the layers `s3_cpu.decoder_layer` runs: fp32 over bf16 weights
    on the C++ kernels, one q|k|v and one gate|up linear, SiLU, no per-head norms, no Gemma sandwich norms."""
    return decoder.reads_bf16_weights and not decoder.gelu and not decoder.gemma and all(
        len(layer.qkv) == 1 and len(layer.gate_up) == 1 and layer.q_norm is None and layer.post_attn_norm is None
        and layer.post_mlp_norm is None for layer in decoder.layers)


def serves_step(decoder, num_tokens: int, step: StepAttention | None) -> bool:
    """True when this step of `num_tokens` tokens runs its layers fused: the decoder's layers qualify, the
    step's attention is the C++ CPU backend's, and its linears take this many tokens."""
    return (step is not None and decoder.fused_layers and step.backend.name == "cpu"
            and num_tokens <= decoder.lm_head.few_token_max)


def run_layers(decoder, residual: torch.Tensor, positions: torch.Tensor, step: StepAttention) -> torch.Tensor:
    """Every layer over residual [T, hidden] (updated in place) at positions [T]; returns the last layer's output
    [T, hidden], which the final norm adds to the residual. Attention's time goes to `step.elapsed_s`."""
    ops = torch.ops.s3_cpu
    meta = step.meta
    seconds = torch.zeros((), dtype=torch.float64)
    hidden = torch.empty_like(residual)  # [T, hidden]; the first layer writes rms_norm(residual) into it
    for index, layer in enumerate(decoder.layers):
        k_cache, v_cache = step.kv_caches[index]
        qkv, gate_up = layer.qkv[0], layer.gate_up[0]
        hidden = ops.decoder_layer(
            hidden, residual, positions, layer.input_norm, qkv.few_weight, qkv.few_bias, layer.o_proj.few_weight,
            layer.o_proj.few_bias, layer.pre_mlp_norm, gate_up.few_weight, layer.down.few_weight,
            decoder.cos_sin[layer.rope], k_cache, v_cache, meta.slot_mapping, meta.block_tables,
            meta.query_start_loc, meta.seq_lens, decoder.num_heads, decoder.num_kv_heads, decoder.head_dim,
            decoder.eps, decoder.scale, layer.window, seconds, index == 0)
    step.elapsed_s += float(seconds)
    return hidden
