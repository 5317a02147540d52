"""A decoder-only transformer run from its Hugging Face weights with few ops per layer: the engine's fast path.

Hugging Face's module stack spends more time dispatching small ops than
multiplying on a 135M model (30 layers x ~45 ops; measured: 40 ms per bf16 step
at one token, of which the matmuls take under half). This forward runs the same
arithmetic in 9 ops per Llama layer:

    residual += h ; h = rms_norm(residual)        fused_add_rms_norm   (the first layer: rms_norm)
    q | k | v = h @ W_qkv                          one linear (bf16: the three weights packed as one)
    rotate q, k in place                           rotary_embedding
    o = attention(q, k, v)  (appends k, v)         the backend's paged attention
    residual += o @ W_o ; h = rms_norm(residual)   linear, fused_add_rms_norm
    h = act(h @ W_gate) * (h @ W_up) @ W_down      linear, silu_and_mul, linear

The same forward serves the layer shapes of the other families (`ARCHITECTURES`):
biases on q, k, v (Qwen2); an RMSNorm over each head of q and k before the
rotation (Qwen3, Gemma 3); fused qkv_proj and gate_up_proj weights (Phi-3); a
sliding window on some or all layers (Mistral, Qwen2, Phi-3, Gemma 3), passed to
the attention per layer; and Gemma 3's own: embeddings scaled by sqrt(hidden),
a norm after attention and after the MLP as well as before each, norms that
multiply by (1 + w) in float32 before rounding (the norm kernels take a float32
weight for that), one rotary table per layer type (local and global bases), a
tanh-GELU MLP and `query_pre_attn_scalar` as the attention scale.

The linears are `workers.engine.fast_linear.Linear`: oneDNN-packed bf16, few-token C++ kernels (AMX tiles,
vdpbf16ps, bf16 weights under fp32 arithmetic), or `F.linear`, the very op HF calls. On AVX2-only CPUs with
bf16 weights the layers of a step may run as one C++ op each (`workers.engine.fused_layers`).
The elementwise kernels round to bf16 where HF's bf16 modules round, so logits
track HF's bf16 forward (the tests state the tolerance).

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

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kv_kernels import cpu_build, cpu_kernels, torch_layer_ops
from workers.engine import cpu_kind, fused_layers
from workers.engine.attention import StepAttention
from workers.engine.fast_linear import Linear, few_token_kernel, onednn_packs_bf16
from workers.engine.huge_page_arena import HugePageArena
from workers.engine.linear_weights import has_bf16_linear_weights

# Attention for one layer: (layer index, q [T, H, D], k [T, KVH, D], v [T, KVH, D], sliding window in tokens or 0)
# -> [T, H, D]
AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]

# the model_types the fast path serves; each family's layer shape is read from its own modules
ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3_text")
# longrope and dynamic change the frequencies with the sequence's length; a table built once cannot
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


def _activation(config) -> str:
    return getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")


def _rope_types(rotary_emb: torch.nn.Module) -> list[str]:
    rope_type = getattr(rotary_emb, "rope_type", "default")
    return list(rope_type.values()) if isinstance(rope_type, dict) else [rope_type]  # Gemma 3: per layer type


def _is_gemma(config) -> bool:
    return str(getattr(config, "model_type", "")).startswith("gemma")


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why this model cannot take the fast path, or None if it can."""
    config = model.config
    model_type = getattr(config, "model_type", None)
    if model_type not in ARCHITECTURES:
        return f"model_type {model_type!r} has no fast path (it serves {', '.join(ARCHITECTURES)})"
    if next(model.parameters()).device.type not in ("cpu", "cuda"):
        return "the fast path runs on CPU and CUDA"
    if model.dtype not in (torch.float32, torch.bfloat16):
        return f"dtype {model.dtype} (the fast path runs float32 and bfloat16)"
    if _activation(config) not in ACTIVATIONS:
        return f"activation {_activation(config)!r} is not one of {', '.join(ACTIVATIONS)}"
    if getattr(config, "mlp_bias", False):
        return "MLP biases"
    if getattr(config, "final_logit_softcapping", None):
        return "final logit softcapping"
    for rope_type in _rope_types(model.model.rotary_emb):
        if rope_type not in STATIC_ROPE_TYPES:
            return f"rope_type {rope_type!r} changes with sequence length"
    head_dim = _head_dim(config)
    if head_dim % 2:
        return f"odd head_dim {head_dim}"
    rotary_dim = getattr(model.model.rotary_emb, "inv_freq", torch.empty(head_dim // 2)).numel() * 2
    if rotary_dim != head_dim:
        return f"partial rotary embedding ({rotary_dim} of {head_dim} dims)"
    return None


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


@dataclass(slots=True)
class _Layer:
    input_norm: torch.Tensor  # [hidden]; float32 (1 + w) for Gemma's rounding, else the model's dtype
    pre_mlp_norm: torch.Tensor  # [hidden]: Llama's post_attention_layernorm, Gemma's pre_feedforward_layernorm
    post_attn_norm: torch.Tensor | None  # [hidden], Gemma: normalises the attention output before the residual add
    post_mlp_norm: torch.Tensor | None  # [hidden], Gemma: normalises the MLP output before the residual add
    q_norm: torch.Tensor | None  # [head_dim], Qwen3 and Gemma 3: RMSNorm of each head of q, then of k
    k_norm: torch.Tensor | None
    qkv: list[Linear]  # one [q | k | v] linear (CPU bf16 or bf16 weights, CUDA, Phi-3), or q, k, v apart (CPU fp32)
    o_proj: Linear
    gate_up: list[Linear]  # one [gate | up] linear, or gate, up apart
    down: Linear
    window: int  # sliding window in tokens, 0 for a layer that sees its whole context
    rope: int  # index of the layer's rotary table


def _cat_bias(*linears: torch.nn.Linear) -> torch.Tensor | None:
    if all(linear.bias is None for linear in linears):
        return None
    return torch.cat([linear.bias if linear.bias is not None else torch.zeros(linear.out_features,
                      dtype=linear.weight.dtype, device=linear.weight.device) for linear in linears])


class FastDecoder:
    """Forward of a decoder-only causal LM of one of `ARCHITECTURES` over paged KV, one ragged batch per call.

    Args:
        model: the HF model (eval mode, CPU or CUDA, float32 or bfloat16); see `unsupported_reason`.
        max_positions: positions the rotary tables cover (the engine's max_model_len).
        ops: the elementwise ops (`kv_kernels.cpu_kernels` or `kv_kernels.torch_layer_ops`); None: the C++
            kernels on CPU, the torch ops elsewhere.
    """

    def __init__(self, model: torch.nn.Module, max_positions: int, ops=None) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"FastDecoder cannot run this model: {reason}")
        config = model.config
        self.device = next(model.parameters()).device
        self.ops = ops or (cpu_kernels if self.device.type == "cpu" else torch_layer_ops)
        if self.ops is cpu_kernels:
            cpu_build.load()  # the fused ops; builds once if `make setup` did not
        self.dtype = model.dtype
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = _head_dim(config)
        self.eps = float(config.rms_norm_eps)
        self.gemma = _is_gemma(config)
        self.gelu = _activation(config) == "gelu_pytorch_tanh"
        inner = model.model
        # oneDNN-packed weights: CPU bf16 only; CUDA concatenates the q|k|v and gate|up weights unpacked
        self.is_packed = self.device.type == "cpu" and self.dtype == torch.bfloat16 and onednn_packs_bf16()
        # fp32 arithmetic over bf16 weights (`workers.engine.linear_weights`), on the CPUs whose kernels widen them
        self.reads_bf16_weights = (self.ops is cpu_kernels and self.dtype == torch.float32
                                   and has_bf16_linear_weights(model) and cpu_kind.this_cpu().widens_bf16_weights)
        self.concatenates = self.is_packed or self.device.type == "cuda" or self.reads_bf16_weights
        # the few-token kernel: where the C++ kernels run, this CPU kind's that their build runs natively
        self.few_token = few_token_kernel() if self.is_packed and self.ops is cpu_kernels else None
        if self.reads_bf16_weights:
            self.few_token = "bf16_weight_linear"
        self.embed_weight = inner.embed_tokens.weight  # [vocab, hidden]
        embed_scale = getattr(inner.embed_tokens, "embed_scale", None)  # Gemma: sqrt(hidden), in the model's dtype
        self.embed_scale = None if embed_scale is None else embed_scale.to(self.dtype)
        self.final_norm = self._norm(inner.norm)
        # the few-token kernels' weights, streamed every decode step; None where there are none
        self.arena = HugePageArena() if self.few_token is not None else None
        self.lm_head = self._linear(model.lm_head.weight, getattr(model.lm_head, "bias", None))
        layer_types = list(getattr(config, "layer_types", None) or ["full_attention"] * len(inner.layers))
        # [max_positions, head_dim] float32 per distinct rotary table (Gemma 3: local and global bases)
        self.cos_sin, rope_index = self._rotary_tables(inner.rotary_emb, layer_types, max_positions)
        self.layers = [self._layer(layer, config, rope_index[kind]) for layer, kind in zip(inner.layers, layer_types)]
        self.scale = float(inner.layers[0].self_attn.scaling)
        self.fused_layers = fused_layers.fuses_layers(self)  # one C++ op per layer where the step allows

    def _norm(self, norm: torch.nn.Module | None) -> torch.Tensor | None:
        if norm is None:
            return None
        with torch.no_grad():  # Gemma3RMSNorm multiplies by (1 + w) in float32: the kernels' float32 weight
            return (1.0 + norm.weight.float()).contiguous() if self.gemma else norm.weight

    def _linear(self, weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
        """A linear of this decoder's kind (packed or not, its few-token kernel, weights in its arena)."""
        return Linear(weight, bias, self.is_packed, self.few_token, self.arena)

    def _cat(self, weights: list[torch.Tensor]) -> torch.Tensor:
        """The weights stacked [sum of out, in]; over bf16 weights in bf16 (no fp32 concatenation made)."""
        return torch.cat([w.to(torch.bfloat16) for w in weights] if self.reads_bf16_weights else weights)

    def _layer(self, layer: torch.nn.Module, config, rope: int) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        with torch.no_grad():
            if hasattr(attn, "qkv_proj"):  # Phi-3 keeps them fused
                qkv = [self._linear(attn.qkv_proj.weight, attn.qkv_proj.bias)]
            elif self.concatenates:
                projections = [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]
                qkv = [self._linear(self._cat(projections), _cat_bias(attn.q_proj, attn.k_proj, attn.v_proj))]
            else:
                qkv = [Linear(p.weight, p.bias, False) for p in (attn.q_proj, attn.k_proj, attn.v_proj)]
            if hasattr(mlp, "gate_up_proj"):
                gate_up = [self._linear(mlp.gate_up_proj.weight, None)]
            elif self.concatenates:
                projections = [mlp.gate_proj.weight, mlp.up_proj.weight]
                gate_up = [self._linear(self._cat(projections), None)]
            else:
                gate_up = [Linear(mlp.gate_proj.weight, None, False), Linear(mlp.up_proj.weight, None, False)]
        # what the HF module passes its attention as sliding_window: its own (per layer) or the config's
        window = attn.sliding_window if hasattr(attn, "sliding_window") else getattr(config, "sliding_window", None)
        sandwich = hasattr(layer, "pre_feedforward_layernorm")  # Gemma: norms after attention and MLP too
        return _Layer(
            input_norm=self._norm(layer.input_layernorm),
            pre_mlp_norm=self._norm(layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm),
            post_attn_norm=self._norm(layer.post_attention_layernorm) if sandwich else None,
            post_mlp_norm=self._norm(layer.post_feedforward_layernorm) if sandwich else None,
            q_norm=self._norm(getattr(attn, "q_norm", None)),
            k_norm=self._norm(getattr(attn, "k_norm", None)),
            qkv=qkv,
            o_proj=self._linear(attn.o_proj.weight, attn.o_proj.bias),
            gate_up=gate_up,
            down=self._linear(mlp.down_proj.weight, None),
            window=int(window or 0),
            rope=rope,
        )

    def _rotary_tables(self, rotary_emb: torch.nn.Module, layer_types: list[str],
                       max_positions: int) -> tuple[list[torch.Tensor], dict[str, int]]:
        """One cos|sin table [max_positions, head_dim] float32 per rotary the layers use, and each layer type's.

        HF's own module computes cos/sin (rounded to the model's dtype), so the values are its values; a module
        that takes `layer_type` (Gemma 3) has one set of frequencies per type.
        """
        per_type = "layer_type" in inspect.signature(rotary_emb.forward).parameters
        kinds = list(dict.fromkeys(layer_types)) if per_type else [None]
        positions = torch.arange(max_positions, device=self.device)[None]  # [1, P]
        probe = torch.empty((), dtype=self.dtype, device=self.device)
        half = self.head_dim // 2
        tables = []
        with torch.no_grad():
            for kind in kinds:
                cos, sin = rotary_emb(probe, positions, **({} if kind is None else {"layer_type": kind}))
                # each [1, P, head_dim], halves repeated
                tables.append(torch.cat([cos[0, :, :half], sin[0, :, :half]], dim=-1).float().contiguous())
        index = {kind: (kinds.index(kind) if per_type else 0) for kind in layer_types}
        return tables, index

    def _act(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[gate | up] [T, 2I] -> act(gate) * up [T, I]."""
        if not self.gelu:
            return self.ops.silu_and_mul(gate_up)
        width = gate_up.shape[1] // 2  # HF's own ops: tanh-GELU rounded, then the product rounded
        return F.gelu(gate_up[:, :width], approximate="tanh") * gate_up[:, width:]

    def _head_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm over each head of x [T, heads * D] -> a new [T, heads * D]."""
        rows = x.reshape(-1, self.head_dim)  # [T * heads, D], a copy when x is a column slice of q|k|v
        return self.ops.rms_norm(rows, weight, self.eps).view(x.shape[0], -1)

    def _layers(self, residual: torch.Tensor, positions: torch.Tensor, attention: AttentionFn) -> torch.Tensor:
        """Every layer over residual [T, hidden] (updated) from Python; returns the last layer's output [T, hidden]."""
        ops, num_tokens = self.ops, residual.shape[0]
        q_width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
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
            if layer.q_norm is not None:
                q, k = self._head_norm(q, layer.q_norm), self._head_norm(k, layer.k_norm)
            ops.rotary_embedding(positions, q, k, self.cos_sin[layer.rope], self.head_dim)
            out = attention(
                index,
                q.view(num_tokens, self.num_heads, self.head_dim),
                k.view(num_tokens, self.num_kv_heads, self.head_dim),
                v.view(num_tokens, self.num_kv_heads, self.head_dim),
                layer.window,
            )  # [T, H, D]
            hidden = layer.o_proj(out.view(num_tokens, q_width))
            if layer.post_attn_norm is not None:
                hidden = ops.rms_norm(hidden, layer.post_attn_norm, self.eps)
            ops.fused_add_rms_norm(hidden, residual, layer.pre_mlp_norm, self.eps)
            if len(layer.gate_up) == 1:
                act = self._act(layer.gate_up[0](hidden))  # [T, intermediate]
            else:
                gate, up = (linear(hidden) for linear in layer.gate_up)
                act = (F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)) * up  # HF's own ops
            hidden = layer.down(act)
            if layer.post_mlp_norm is not None:
                hidden = ops.rms_norm(hidden, layer.post_mlp_norm, self.eps)
        return hidden

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionFn,
                sample_rows: torch.Tensor, step: StepAttention | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids, positions [T] int64; returns logits [N, vocab] and the final-norm hidden states [N, hidden]
        of the N = len(sample_rows) rows, both in the model's dtype (the hidden rows are the lm_head's input).
        `step`: the step's paged attention behind `attention`, for the fused layers (`workers.engine.fused_layers`)."""
        num_tokens = input_ids.shape[0]
        residual = F.embedding(input_ids, self.embed_weight)  # [T, hidden]
        if self.embed_scale is not None:
            residual = residual * self.embed_scale
        if fused_layers.serves_step(self, num_tokens, step):
            hidden = fused_layers.run_layers(self, residual, positions, step)
        else:
            hidden = self._layers(residual, positions, attention)
        self.ops.fused_add_rms_norm(hidden, residual, self.final_norm, self.eps)
        rows = hidden.index_select(0, sample_rows)  # [N, hidden]
        return self.lm_head(rows), rows  # [N, vocab], [N, hidden]
