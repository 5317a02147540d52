"""A Llama-family decoder run from its Hugging Face weights with few ops per layer: the engine's fast path.

Hugging Face's module stack spends more time dispatching small ops than
multiplying on a 135M model (30 layers x ~45 ops; measured: 40 ms per bf16 step
at one token, of which the matmuls take under half). This forward runs the same
arithmetic in 9 ops per layer:

    residual += h ; h = rms_norm(residual)        fused_add_rms_norm   (the first layer: rms_norm)
    q | k | v = h @ W_qkv                          one linear (bf16: the three weights packed as one)
    rotate q, k in place                           rotary_embedding
    o = attention(q, k, v)  (appends k, v)         the backend's paged attention
    residual += o @ W_o ; h = rms_norm(residual)   linear, fused_add_rms_norm
    h = silu(h @ W_gate) * (h @ W_up) @ W_down     linear, silu_and_mul, linear

In bf16 the linears use oneDNN weights packed once for AMX/AVX512-BF16 (1.5-2x
faster than `F.linear` here); in fp32 they are `F.linear`, the very op HF calls.
The elementwise kernels round to bf16 where HF's bf16 modules round, so logits
track HF's bf16 forward (the test states the tolerance).

Weights are shared with the HF model (fp32) or packed copies of them (bf16);
the HF model stays usable as the reference.

On CUDA the same forward runs with `kv_kernels.torch_layer_ops` (the same four
elementwise ops written as HF's own torch ops) and one cuBLAS GEMM for each of
[q | k | v] and [gate | up]: HF's module stack costs a 7B model on an H100 more
host time per step than the GPU needs for its arithmetic.

Why not `torch.compile` (measured here, SmolLM2 bf16, dense part only): inductor
with freezing (which packs the weights) gives 21 ms at 1 token and 42 ms at 128,
but compiles for ~70 s at every start (freezing bypasses the compile cache) and
recompiles per shape class; this forward gives 16 ms and 38 ms with no start-up cost.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kv_kernels import cpu_build, cpu_kernels, torch_layer_ops

# Attention for one layer: (layer index, q [T, H, D], k [T, KVH, D], v [T, KVH, D]) -> [T, H, D]
AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why this model cannot take the fast path, or None if it can."""
    config = model.config
    if getattr(config, "model_type", None) != "llama":
        return f"model_type {getattr(config, 'model_type', None)!r} is not llama"
    if next(model.parameters()).device.type not in ("cpu", "cuda"):
        return "the fast path runs on CPU and CUDA"
    if model.dtype not in (torch.float32, torch.bfloat16):
        return f"dtype {model.dtype} (the fast path runs float32 and bfloat16)"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r} is not silu"
    if getattr(config, "mlp_bias", False):
        return "MLP biases"
    rope_type = getattr(model.model.rotary_emb, "rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        return f"rope_type {rope_type!r} changes with sequence length"
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim % 2:
        return f"odd head_dim {head_dim}"
    return None


class _Linear:
    """y = x @ W^T (+ b) for x [T, in]; oneDNN-packed weights in bf16 on CPU, `F.linear` otherwise."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, pack: bool) -> None:
        self.bias = bias
        self.weight = None if pack else weight
        # packed: opaque oneDNN layout of `weight`, chosen once for AMX / AVX512-BF16
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None) if pack else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


@dataclass(slots=True)
class _Layer:
    input_norm: torch.Tensor  # [hidden]
    post_norm: torch.Tensor  # [hidden]
    qkv: list[_Linear]  # one [q | k | v] linear (CPU bf16, CUDA), or q, k, v apart (CPU fp32: HF's own calls)
    o_proj: _Linear
    gate_up: list[_Linear]  # one packed [gate | up] linear, or gate, up apart
    down: _Linear


def _cat_bias(*linears: torch.nn.Linear) -> torch.Tensor | None:
    if all(linear.bias is None for linear in linears):
        return None
    return torch.cat([linear.bias if linear.bias is not None else torch.zeros(linear.out_features,
                      dtype=linear.weight.dtype, device=linear.weight.device) for linear in linears])


class FastLlama:
    """Forward of a `LlamaForCausalLM` over paged KV, one ragged batch per call.

    Args:
        model: the HF model (eval mode, CPU or CUDA, float32 or bfloat16); see `unsupported_reason`.
        max_positions: positions the rotary table covers (the engine's max_model_len).
        ops: the elementwise ops (`kv_kernels.cpu_kernels` or `kv_kernels.torch_layer_ops`); None: the C++
            kernels on CPU, the torch ops elsewhere.
    """

    def __init__(self, model: torch.nn.Module, max_positions: int, ops=None) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"FastLlama cannot run this model: {reason}")
        config = model.config
        self.device = next(model.parameters()).device
        self.ops = ops or (cpu_kernels if self.device.type == "cpu" else torch_layer_ops)
        if self.ops is cpu_kernels:
            cpu_build.load()  # the fused ops; builds once if `make setup` did not
        self.dtype = model.dtype
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.eps = float(config.rms_norm_eps)
        inner = model.model
        # oneDNN-packed weights: CPU bf16 only; CUDA concatenates the q|k|v and gate|up weights unpacked
        self.is_packed = (self.device.type == "cpu" and self.dtype == torch.bfloat16
                          and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))
        self.concatenates = self.is_packed or self.device.type == "cuda"
        self.embed_weight = inner.embed_tokens.weight  # [vocab, hidden]
        self.final_norm = inner.norm.weight
        self.lm_head = _Linear(model.lm_head.weight, getattr(model.lm_head, "bias", None), self.is_packed)
        self.layers = [self._layer(layer) for layer in inner.layers]
        self.scale = float(inner.layers[0].self_attn.scaling)
        self.cos_sin = self._rotary_table(inner.rotary_emb, max_positions)  # [max_positions, head_dim] float32

    def _layer(self, layer: torch.nn.Module) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        with torch.no_grad():
            if self.concatenates:
                qkv_weight = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
                qkv = [_Linear(qkv_weight, _cat_bias(attn.q_proj, attn.k_proj, attn.v_proj), self.is_packed)]
                gate_up = [_Linear(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]), None, self.is_packed)]
            else:
                qkv = [_Linear(p.weight, p.bias, False) for p in (attn.q_proj, attn.k_proj, attn.v_proj)]
                gate_up = [_Linear(mlp.gate_proj.weight, None, False), _Linear(mlp.up_proj.weight, None, False)]
        return _Layer(
            input_norm=layer.input_layernorm.weight,
            post_norm=layer.post_attention_layernorm.weight,
            qkv=qkv,
            o_proj=_Linear(attn.o_proj.weight, attn.o_proj.bias, self.is_packed),
            gate_up=gate_up,
            down=_Linear(mlp.down_proj.weight, None, self.is_packed),
        )

    def _rotary_table(self, rotary_emb: torch.nn.Module, max_positions: int) -> torch.Tensor:
        # HF's own module computes cos/sin (rounded to the model's dtype), so the values are its values.
        positions = torch.arange(max_positions, device=self.device)[None]  # [1, P]
        probe = torch.empty((), dtype=self.dtype, device=self.device)
        with torch.no_grad():
            cos, sin = rotary_emb(probe, positions)  # each [1, P, head_dim], halves repeated
        half = self.head_dim // 2
        return torch.cat([cos[0, :, :half], sin[0, :, :half]], dim=-1).float().contiguous()

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionFn,
                sample_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids, positions [T] int64; returns logits [N, vocab] and the final-norm hidden states [N, hidden]
        of the N = len(sample_rows) rows, both in the model's dtype (the hidden rows are the lm_head's input)."""
        ops = self.ops
        num_tokens = input_ids.shape[0]
        q_width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        residual = F.embedding(input_ids, self.embed_weight)  # [T, hidden]
        hidden = None
        for index, layer in enumerate(self.layers):
            if hidden is None:
                hidden = ops.rms_norm(residual, layer.input_norm, self.eps)
            else:
                ops.fused_add_rms_norm(hidden, residual, layer.input_norm, self.eps)
            if len(layer.qkv) == 1:
                qkv = layer.qkv[0](hidden)  # [T, q_width + 2 kv_width]
                q, k, v = qkv[:, :q_width], qkv[:, q_width:q_width + kv_width], qkv[:, q_width + kv_width:]
            else:
                q, k, v = (linear(hidden) for linear in layer.qkv)
            ops.rotary_embedding(positions, q, k, self.cos_sin, self.head_dim)
            out = attention(
                index,
                q.view(num_tokens, self.num_heads, self.head_dim),
                k.view(num_tokens, self.num_kv_heads, self.head_dim),
                v.view(num_tokens, self.num_kv_heads, self.head_dim),
            )  # [T, H, D]
            hidden = layer.o_proj(out.view(num_tokens, q_width))
            ops.fused_add_rms_norm(hidden, residual, layer.post_norm, self.eps)
            if len(layer.gate_up) == 1:
                act = ops.silu_and_mul(layer.gate_up[0](hidden))  # [T, intermediate]
            else:
                act = F.silu(layer.gate_up[0](hidden)) * layer.gate_up[1](hidden)  # HF's own ops
            hidden = layer.down(act)
        ops.fused_add_rms_norm(hidden, residual, self.final_norm, self.eps)
        rows = hidden.index_select(0, sample_rows)  # [N, hidden]
        return self.lm_head(rows), rows  # [N, vocab], [N, hidden]
