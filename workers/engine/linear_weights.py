"""bf16 linear weights under fp32 arithmetic: what `dtype auto` means on CPUs without bf16 instructions.

Such CPUs (AVX2 only: AMD Zen 1-3, Intel client cores) compute in fp32, and a decode step of a few
sequences is bound by reading the weights: fp32 weights are twice the bytes of 16-bit ones. Where the CPU
kernels widen bf16 to fp32 in registers (`s3_cpu.bf16_weight_linear`, built for AVX2 and FMA, no AVX-512)
and the fast path serves the model, `dtype auto` keeps the linear layers' weights at bf16 values, the
weights a CPU with bf16 instructions serves: they are rounded once in the model (the bundled GGUF models
and fp32 checkpoints lose what bf16 cannot hold, as on such CPUs), and the fast path reads a bf16 copy
(`workers.engine.fast_decoder`) at every step; the model keeps its fp32 tensors (HF's modules, the
reference), so the copy costs memory for half the weights again (`bf16_copy_bytes`, taken from the KV
budget's free memory). Activations, norms, attention and the KV cache stay fp32. This is what llama.cpp
does with a 16-bit GGUF and OpenVINO with its fp16 export on these CPUs. `dtype float32` keeps fp32
weights; AVX-512 CPUs without bf16 (Skylake-SP, Cascade Lake) and other CPUs compute in plain fp32.
"""

import torch

from workers.engine import cpu_kind

BF16_LINEAR_WEIGHTS = "s3serve_bf16_linear_weights"  # set (True) on a model whose linear weights hold bf16 values


def reads_bf16_weights(dtype_name: str, device) -> bool:
    """True when `dtype_name` on `device` means fp32 arithmetic over bf16 linear weights: auto, on a CPU without
    bf16 instructions that has AVX2 and FMA but no AVX-512 (`CpuKind.widens_bf16_weights`), for which the kernels'
    build (-march=native) widens bf16 weights natively (`s3_cpu.bf16_weight_linear_native`; a test holds the two
    to the same flags)."""
    return dtype_name == "auto" and torch.device(device).type == "cpu" and cpu_kind.this_cpu().widens_bf16_weights


def round_linear_weights_to_bf16(model: torch.nn.Module) -> torch.nn.Module:
    """Round every linear layer's weight of an fp32 `model` to bf16 values in place (a tied embedding with
    them) and mark the model, so the fast path reads them as bf16; returns the model."""
    if model.dtype != torch.float32:
        raise ValueError(f"bf16 linear weights are for an fp32 model, got {model.dtype}")
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(module.weight.to(torch.bfloat16))
    setattr(model, BF16_LINEAR_WEIGHTS, True)
    return model


def as_served(model: torch.nn.Module, device="cpu", dtype_name: str = "auto") -> torch.nn.Module:
    """`model` with the linear weights `dtype_name` serves on `device`: an fp32 model's rounded to bf16 where
    `reads_bf16_weights` (auto on AVX2-only CPUs), as they are elsewhere; returns it. For the tools that run the
    engine beside the service (the benches, labelling), so they measure and label what it serves."""
    if model.dtype == torch.float32 and reads_bf16_weights(dtype_name, device) and not has_bf16_linear_weights(model):
        round_linear_weights_to_bf16(model)
    return model


def precision_label(dtype: torch.dtype, bf16_weights: bool) -> str:
    """How the benches name a model's precision: "bf16", "fp32+bf16w" (fp32 over bf16 linear weights) or "fp32"."""
    return "bf16" if dtype == torch.bfloat16 else "fp32+bf16w" if bf16_weights else "fp32"


def has_bf16_linear_weights(model: torch.nn.Module) -> bool:
    """True when `round_linear_weights_to_bf16` marked the model."""
    return bool(getattr(model, BF16_LINEAR_WEIGHTS, False))


def bf16_copy_bytes(model: torch.nn.Module) -> int:
    """Bytes of the bf16 copies the fast path makes of a marked model's linear weights (0 for another model):
    memory beside the model's own fp32 weights, which serve batches past the kernel's tokens."""
    if not has_bf16_linear_weights(model):
        return 0
    return 2 * sum(module.weight.numel() for module in model.modules() if isinstance(module, torch.nn.Linear))
