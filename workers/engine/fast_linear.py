"""The fast path's linear layers: y = x @ W^T (+ b), each on the fastest kernel this CPU's build has.

In bf16 the linears use oneDNN weights packed once for AMX/AVX512-BF16 (1.5-2x
faster than `F.linear` here); in fp32 they are `F.linear`, the very op HF calls, except over bf16
weights (`workers.engine.linear_weights`), read by `s3_cpu.bf16_weight_linear` at any number of tokens.
A decode step of one to a few dozen tokens reads every weight for a handful of
rows, and oneDNN's kernels stream them at 7-10 GB/s of this machine's ~22: up to
32 tokens the C++ kernel `s3_cpu.amx_linear` runs AMX tiles over a copy of the
weights packed for them (14-15 GB/s; `kv_kernels/csrc/amx_linear.cpp`), and on
CPUs with AVX512-BF16 but no AMX `s3_cpu.small_linear` dots the plain weights
with vdpbf16ps at one token (`kv_kernels/csrc/linear_ops.cpp`).
The few-token kernels' packed weights, streamed every decode step, live in huge pages (`workers.engine.huge_page_arena`).
"""

import torch
import torch.nn.functional as F

from kv_kernels import cpu_kernels
from workers.engine import cpu_kind
from workers.engine.huge_page_arena import HugePageArena

# Few-token CPU bf16 kernels, by name, and the most tokens each takes; past that, oneDNN's packed linear.
# Measured here streaming SmolLM2's 30 layers and head: `amx_linear` (AMX tiles on a weight packed for them)
# 14-15 GB/s from 1 to 16 tokens and 10-11 at 32, oneDNN 7-10 GB/s over the same range and even at 48;
# `small_linear` (vdpbf16ps on the plain weight, for CPUs with AVX512-BF16 but no AMX) wins at 1 token only.
# `bf16_weight_linear`, the fp32 engine's on AVX2-only CPUs with bf16 linear weights (`workers.engine.linear_weights`),
# streams them packed in 16-column panels, up to 6 tokens per widened weight; against `F.linear` on fp32 weights
# (Zen 3, SmolLM2's linears, in one process) 3.6x at 1 token, 2.4-2.7x at 4-32, 1.4x at 128; against the
# per-part `F.linear` and concatenation it replaces, 1.06x at 256, 1.2-1.3x at 384-4096 (2026-11-28): no limit.
FEW_TOKEN_KERNELS = {"amx_linear": 32, "small_linear": 1, "bf16_weight_linear": 1 << 62}
BF16_FEW_TOKEN_KERNELS = ("amx_linear", "small_linear")  # the bf16 ones, fastest first


def few_token_kernel(below: str | None = None) -> str | None:
    """The fastest few-token bf16 kernel (of BF16_FEW_TOKEN_KERNELS; with `below`, of those slower than it) that
    this CPU's kind runs (`CpuKind.bf16_few_token_kernels`) and the CPU kernels' build runs natively here (AMX tile
    state granted, the instructions compiled in), or None."""
    kernels = BF16_FEW_TOKEN_KERNELS[BF16_FEW_TOKEN_KERNELS.index(below) + 1:] if below else BF16_FEW_TOKEN_KERNELS
    runs = cpu_kind.this_cpu().bf16_few_token_kernels
    return next((name for name in kernels if name in runs and getattr(torch.ops.s3_cpu, f"{name}_native")()), None)


def onednn_packs_bf16() -> bool:
    """True when oneDNN packs and runs bf16 linears on this CPU (AVX512-BF16, AMX or AVX-NE-CONVERT; not AVX2 alone)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


class Linear:
    """y = x @ W^T (+ b) for x [T, in]; oneDNN-packed weights in bf16 on CPU, `F.linear` otherwise. With a
    `few_token` kernel (a FEW_TOKEN_KERNELS name), CPU bf16 calls of up to its token limit run it on its own copy
    of the weight: the tile layout for `amx_linear` (a third copy of the bf16 weights in memory, beside the model's
    and oneDNN's), the model's plain weight for `small_linear` (concatenated q|k|v and gate|up: copies), a bf16 copy
    for `bf16_weight_linear` packed in its panels (fp32 calls over bf16 weights: the model's weights hold bf16
    values; `kv_kernels.cpu_kernels.bf16_weight_pack`)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, pack: bool,
                 few_token: str | None = None, arena: HugePageArena | None = None) -> None:
        self.bias = bias
        # bf16_weight_linear takes every step (FEW_TOKEN_KERNELS): no weight is kept for F.linear beside its copy
        self.weight = None if pack or few_token == "bf16_weight_linear" else weight
        # packed: opaque oneDNN layout of `weight`, chosen once for AMX / AVX512-BF16
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None) if pack else None
        if few_token == "amx_linear" and weight.shape[1] % 32:  # the tiles take whole 32-deep slices of the input
            few_token = few_token_kernel(below="amx_linear")
        self.few_token = few_token
        self.few_token_max = FEW_TOKEN_KERNELS[few_token] if few_token else 0
        self.few_op = getattr(torch.ops.s3_cpu, few_token) if few_token else None  # looked up once, not per call
        self.out_features = weight.shape[0]
        # [N_pad/64, in/32, 4, 16, 32] for amx_linear, [out, in] for small_linear, [N_pad/16, in, 16] for
        # bf16_weight_linear
        self.few_weight = None
        if few_token is not None:
            plain = weight.detach().contiguous()
            if few_token == "amx_linear":
                self.few_weight = cpu_kernels.amx_pack(plain)
            elif few_token == "bf16_weight_linear":
                self.few_weight = cpu_kernels.bf16_weight_pack(plain)  # the fp32 weight holds bf16 values: exact
            else:
                self.few_weight = plain
            # the packed copies, streamed every step, into huge pages; small_linear's plain weight is often the
            # model's own tensor, which a copy would double in memory
            if arena is not None and few_token != "small_linear":
                self.few_weight = arena.hold(self.few_weight)
        self.few_bias = None if bias is None or few_token is None else bias.detach().contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.few_op is not None and x.shape[0] <= self.few_token_max:
            out = x.new_empty(x.shape[0], self.out_features)  # [T, out]
            self.few_op(out, x.contiguous(), self.few_weight, self.few_bias)
            return out
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
