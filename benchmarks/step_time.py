"""How long one engine step takes, without running it: the simulator's clock.

A step is described by what the scheduler put in it (`StepShape`): sequences, tokens computed,
and context tokens attended over. Two models turn it into seconds:

* `RooflineStepModel`, for a GPU kind and a model shape: a fixed overhead per step and per
  sequence, plus the larger of memory time (weights once, every attended KV token, the KV
  written) over bandwidth and compute time (2 FLOPs per parameter per token, plus attention)
  over peak. Datasheet bandwidth and peak are scaled by achievable fractions (`GpuKind`).
* `LinearStepModel`, calibrated on the CPU engine's own measured steps: on two CPU cores
  memory and compute barely overlap, so the terms add:
  `overhead + per_seq * seqs + per_token * tokens + per_context_token * context`, fitted by
  non-negative least squares; `calibration_error` says how well it fits.
"""

from dataclasses import dataclass

from workers.engine.model_shapes import MODEL_SHAPES, shape_parameters
from workers.values.step_output import StepShape


@dataclass(frozen=True, slots=True)
class GpuKind:
    """A GPU as the roofline sees it (datasheet numbers, dense bf16).

    Attributes:
        memory_bytes: device memory.
        bandwidth_bytes_per_s: HBM bandwidth.
        peak_flops: dense bf16 tensor-core peak.
        bandwidth_efficiency, flops_efficiency: fractions of those a serving engine reaches.
        step_overhead_s, seq_overhead_s: host-side cost per step and per sequence in it
            (scheduling, input preparation, sampling, launch gaps).
    """

    name: str
    memory_bytes: float
    bandwidth_bytes_per_s: float
    peak_flops: float
    bandwidth_efficiency: float = 0.8
    flops_efficiency: float = 0.6
    step_overhead_s: float = 4e-3
    seq_overhead_s: float = 2e-5


GPU_KINDS: dict[str, GpuKind] = {
    "a100-80gb": GpuKind("a100-80gb", 80 * 2**30, 2.039e12, 312e12),
    "h100-sxm": GpuKind("h100-sxm", 80 * 2**30, 3.35e12, 989e12),
    "h200": GpuKind("h200", 141e9, 4.8e12, 989e12),
    "l4": GpuKind("l4", 24 * 2**30, 0.3e12, 121e12),
}


def gpu_kind(name: str) -> GpuKind:
    if name not in GPU_KINDS:
        raise ValueError(f"unknown GPU kind {name!r}; choose from {', '.join(GPU_KINDS)}")
    return GPU_KINDS[name]


@dataclass(frozen=True, slots=True)
class ShapeCost:
    """A model shape's bytes and FLOPs, in the serving dtype.

    Attributes:
        weight_bytes: all parameters, read once per step.
        kv_bytes_per_token: K and V of one token across all layers.
        flops_per_token: 2 per parameter (matrix multiplies), for one computed token.
        attention_flops_per_pair: QK^T and PV for one (query, key) pair across layers and heads.
    """

    name: str
    weight_bytes: int
    kv_bytes_per_token: int
    flops_per_token: int
    attention_flops_per_pair: int


def shape_cost(name: str, dtype_bytes: int = 2) -> ShapeCost:
    if name not in MODEL_SHAPES:
        raise ValueError(f"unknown model shape {name!r}; choose from {', '.join(MODEL_SHAPES)}")
    shape = MODEL_SHAPES[name]
    layers, heads, kv_heads, head_dim = (shape["num_hidden_layers"], shape["num_attention_heads"],
                                         shape["num_key_value_heads"], shape["head_dim"])
    parameters = shape_parameters(name)
    return ShapeCost(name, parameters * dtype_bytes, 2 * layers * kv_heads * head_dim * dtype_bytes,
                     2 * parameters, 4 * layers * heads * head_dim)


class StepModel:
    """Seconds for one step of a given shape (interface of the two models below)."""

    kv_bytes_per_token: int

    def step_s(self, shape: StepShape) -> float:
        raise NotImplementedError

    def swap_s(self, num_bytes: int) -> float:
        """Seconds to copy KV between device and host (preemption by swapping)."""
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError


@dataclass(frozen=True, slots=True)
class RooflineStepModel(StepModel):
    """Roofline time of a model shape on a GPU kind; `host_bytes_per_s` is the PCIe copy rate for swaps."""

    gpu: GpuKind
    cost: ShapeCost
    host_bytes_per_s: float = 20e9

    @property
    def kv_bytes_per_token(self) -> int:
        return self.cost.kv_bytes_per_token

    def step_s(self, shape: StepShape) -> float:
        cost, gpu = self.cost, self.gpu
        num_bytes = cost.weight_bytes + cost.kv_bytes_per_token * (shape.num_context_tokens + shape.num_tokens)
        flops = cost.flops_per_token * shape.num_tokens + cost.attention_flops_per_pair * shape.num_attention_pairs
        memory_s = num_bytes / (gpu.bandwidth_bytes_per_s * gpu.bandwidth_efficiency)
        compute_s = flops / (gpu.peak_flops * gpu.flops_efficiency)
        return gpu.step_overhead_s + gpu.seq_overhead_s * shape.num_seqs + max(memory_s, compute_s)

    def swap_s(self, num_bytes: int) -> float:
        return num_bytes / self.host_bytes_per_s

    def describe(self) -> str:
        gpu = self.gpu
        return (f"roofline {self.cost.name} on {gpu.name}: {gpu.bandwidth_bytes_per_s / 1e12:.2f} TB/s x "
                f"{gpu.bandwidth_efficiency:.2f}, {gpu.peak_flops / 1e12:.0f} TFLOP/s x {gpu.flops_efficiency:.2f}, "
                f"overhead {gpu.step_overhead_s * 1e3:.1f} ms/step + {gpu.seq_overhead_s * 1e6:.0f} us/seq "
                "(datasheet numbers and assumed efficiencies, not measured)")


@dataclass(frozen=True, slots=True)
class LinearStepModel(StepModel):
    """`overhead + per_seq * seqs + per_token * tokens + per_context_token * context`, fitted on measured steps."""

    overhead_s: float
    per_seq_s: float
    per_token_s: float
    per_context_token_s: float
    kv_bytes_per_token: int = 0
    host_bytes_per_s: float = 5e9
    measured_on: str = "the CPU engine"

    def step_s(self, shape: StepShape) -> float:
        return (self.overhead_s + self.per_seq_s * shape.num_seqs + self.per_token_s * shape.num_tokens
                + self.per_context_token_s * shape.num_context_tokens)

    def swap_s(self, num_bytes: int) -> float:
        return num_bytes / self.host_bytes_per_s

    def describe(self) -> str:
        return (f"calibrated on {self.measured_on}: {self.overhead_s * 1e3:.2f} ms/step + {self.per_seq_s * 1e3:.3f} "
                f"ms/seq + {self.per_token_s * 1e3:.3f} ms/token + {self.per_context_token_s * 1e6:.3f} "
                "us/context token")


def _features(shape: StepShape) -> list[float]:
    return [1.0, float(shape.num_seqs), float(shape.num_tokens), float(shape.num_context_tokens)]


def fit_linear(samples: list[tuple[StepShape, float]], kv_bytes_per_token: int = 0,
               measured_on: str = "the CPU engine") -> LinearStepModel:
    """Non-negative least squares over measured (step shape, seconds); needs at least 8 steps."""
    import numpy as np
    from scipy.optimize import nnls

    if len(samples) < 8:
        raise ValueError(f"calibration needs at least 8 measured steps, got {len(samples)}")
    features = np.array([_features(shape) for shape, _ in samples])  # [steps, 4]
    seconds = np.array([s for _, s in samples])  # [steps]
    scale = features.max(axis=0)  # [4], so the terms are fitted on comparable scales
    scale[scale == 0] = 1.0
    coefficients, _ = nnls(features / scale, seconds)
    overhead, per_seq, per_token, per_context = (coefficients / scale).tolist()
    return LinearStepModel(overhead, per_seq, per_token, per_context, kv_bytes_per_token, measured_on=measured_on)


@dataclass(frozen=True, slots=True)
class CalibrationError:
    """How well a step model matches measured steps.

    Attributes:
        mean_abs_pct: mean of |predicted - measured| / measured over steps, in percent.
        total_pct: (sum predicted - sum measured) / sum measured, in percent: the error in total time,
            which is what tokens/s depends on.
    """

    num_steps: int
    mean_abs_pct: float
    total_pct: float


def calibration_error(model: StepModel, samples: list[tuple[StepShape, float]]) -> CalibrationError:
    if not samples:
        raise ValueError("no measured steps to compare with")
    pairs = [(model.step_s(shape), s) for shape, s in samples if s > 0]
    if not pairs:
        raise ValueError("every measured step took 0 s")
    predicted, measured = [p for p, _ in pairs], [m for _, m in pairs]
    mean_abs = sum(abs(p - m) / m for p, m in pairs) / len(pairs)
    total = (sum(predicted) - sum(measured)) / sum(measured)
    return CalibrationError(len(pairs), 100.0 * mean_abs, 100.0 * total)
