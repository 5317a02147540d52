"""bf16 linear weights under fp32 arithmetic: what `dtype auto` means on CPUs without bf16 instructions.

Such CPUs (AVX2 only: AMD Zen 1-3, Intel client cores) compute in fp32, and a decode step of a few
sequences is bound by reading the weights. The checkpoints are bf16, so fp32 weights double the bytes
for no precision. Where the CPU kernels widen bf16 to fp32 in registers (`s3_cpu.bf16_weight_linear`,
built for AVX2 and FMA), `dtype auto` keeps the linear layers' weights at bf16 values: they are rounded
once in the model (which the Hugging Face stack then reads too), and the fast path reads a bf16 copy
(`workers.engine.fast_decoder`). Activations, norms, attention and the KV cache stay fp32. This is
what llama.cpp does with a 16-bit GGUF and OpenVINO with its fp16 export on these CPUs.
`dtype float32` keeps fp32 weights.
"""

import torch

from workers.engine.runtime import cpu_has_bf16

BF16_LINEAR_WEIGHTS = "s3serve_bf16_linear_weights"  # set (True) on a model whose linear weights hold bf16 values


def reads_bf16_weights(dtype_name: str, device) -> bool:
    """True when `dtype_name` on `device` means fp32 arithmetic over bf16 linear weights: auto, on a CPU
    without bf16 instructions whose kernels' build widens bf16 weights natively."""
    if dtype_name != "auto" or torch.device(device).type != "cpu" or cpu_has_bf16():
        return False
    from kv_kernels import cpu_build

    cpu_build.load()
    return bool(torch.ops.s3_cpu.bf16_weight_linear_native())


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


def has_bf16_linear_weights(model: torch.nn.Module) -> bool:
    """True when `round_linear_weights_to_bf16` marked the model."""
    return bool(getattr(model, BF16_LINEAR_WEIGHTS, False))
