"""The kind of CPU the engine runs on, and what each kind means for a model: the one place CPU facts are read.

Every CPU-dependent choice of the engine follows from a few of the CPU's feature flags (/proc/cpuinfo):

    kind         e.g.                           dtype auto  linear weights          few-token kernel      fused layer op
    amx          Intel Sapphire/Granite Rapids  bf16        bf16, oneDNN-packed     amx_linear (<= 32)    no
    avx512_bf16  AMD Zen 4-5, Intel Cooper Lake bf16        bf16, oneDNN-packed     small_linear (1)      no
    avx512       Intel Skylake-SP, Ice Lake     fp32        fp32                    none                  no
    avx2         AMD Zen 1-3, Intel client      fp32        bf16 values, widened    bf16_weight_linear    Llama's shape
    baseline     anything else (aarch64 too)    fp32        fp32                    none                  no

(`workers.engine.runtime.resolve_dtype`, `workers.engine.linear_weights.reads_bf16_weights`,
`workers.engine.fast_linear.few_token_kernel`, `workers.engine.fused_layers.fuses_layers`.) The C++ kernels are
built with -march=native, so a kernel a kind names runs natively where the build has it. Where the build lacks a
few-token bf16 kernel (AMX tile state refused by Linux, an old compiler) the engine takes the next one down; the
widening linear and the fused layer op follow the kind alone, and a build without AVX2 lanes (a `CXX` that
cannot target them) runs them on its portable loop: the same results, slower.

Callers read the CPU through this module, `cpu_kind.this_cpu()`, at the moment they decide (never a copy taken
at import, never `from ... import this_cpu`): a test that fakes a kind (the tests' `fake_cpu` fixture) then
changes every decision at once, and `tests/engine/test_cpu_kind.py` holds the code to that.
"""

from dataclasses import dataclass
from pathlib import Path

# The flags any decision reads; the rest of /proc/cpuinfo's flags change nothing here.
DECISIVE_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")
DTYPE_LABELS = {"bfloat16": "bf16", "float32": "fp32"}


@dataclass(frozen=True)
class CpuKind:
    """A CPU as the engine sees it: its feature flags (and, for reports, its model name)."""

    flags: frozenset[str]
    model_name: str = ""

    @property
    def has_bf16(self) -> bool:
        """Computes bf16 natively (AVX512-BF16 or AMX), where bf16 beats fp32."""
        return bool(self.flags & {"avx512_bf16", "amx_bf16"})

    @property
    def has_amx(self) -> bool:
        """Has AMX bf16 tiles (and AVX512-BF16 beside them, which every such CPU has and the AMX kernel uses)."""
        return {"amx_tile", "amx_bf16", "avx512_bf16"} <= self.flags

    @property
    def widens_bf16_weights(self) -> bool:
        """No bf16 instructions, AVX2 and FMA, no AVX-512: `dtype auto` means fp32 arithmetic over bf16 linear
        weights, widened in AVX2 registers (`s3_cpu.bf16_weight_linear`; `workers.engine.linear_weights`)."""
        return not self.has_bf16 and {"avx2", "fma"} <= self.flags and "avx512f" not in self.flags

    @property
    def name(self) -> str:
        """amx, avx512_bf16, avx512, avx2 or baseline (the table in this module's docstring)."""
        if self.has_amx:
            return "amx"
        if "avx512_bf16" in self.flags:
            return "avx512_bf16"
        if "avx512f" in self.flags:
            return "avx512"
        if {"avx2", "fma"} <= self.flags:
            return "avx2"
        return "baseline"

    @property
    def vector_isa(self) -> str:
        """The vectors the C++ kernels' elementwise and attention code compiles to here: avx512, avx2 or scalar."""
        return "avx512" if "avx512f" in self.flags else "avx2" if {"avx2", "fma"} <= self.flags else "scalar"

    @property
    def native_kernels(self) -> tuple[str, ...]:
        """The kernels a build for this CPU (-march=native) runs natively (each `s3_cpu.<name>_native()`)."""
        return self.bf16_few_token_kernels + (("bf16_weight_linear",) if self.widens_bf16_weights else ())

    @property
    def auto_dtype(self) -> str:
        """What `dtype auto` means for a model on this CPU: bfloat16 where it computes bf16, else float32."""
        return "bfloat16" if self.has_bf16 else "float32"

    @property
    def bf16_few_token_kernels(self) -> tuple[str, ...]:
        """The few-token bf16 linear kernels this CPU runs natively, fastest first (`workers.engine.fast_linear`)."""
        return (("amx_linear",) if self.has_amx else ()) + (("small_linear",) if "avx512_bf16" in self.flags else ())

    def missing_for(self, other: "CpuKind") -> tuple[str, ...]:
        """The decisive flags `other` has and this CPU lacks: why this CPU cannot run `other`'s kernels."""
        return tuple(flag for flag in DECISIVE_FLAGS if flag in other.flags and flag not in self.flags)

    def serves(self, dtype_name: str = "auto") -> "ServedPath":
        """How a model that the fast path serves runs here with `dtype_name` (auto, float32 or bfloat16)."""
        dtype = self.auto_dtype if dtype_name == "auto" else dtype_name
        if dtype == "bfloat16":
            kernels = self.bf16_few_token_kernels
            return ServedPath(self.name, dtype, "bf16, oneDNN-packed" if self.has_bf16 else "bf16",
                              kernels[0] if kernels else None, fused_layers=False)
        if dtype_name == "auto" and self.widens_bf16_weights:
            return ServedPath(self.name, dtype, "bf16 values, widened to fp32", "bf16_weight_linear",
                              fused_layers=True)
        return ServedPath(self.name, dtype, DTYPE_LABELS.get(dtype, dtype), None, fused_layers=False)


@dataclass(frozen=True)
class ServedPath:
    """What a CPU kind serves a model with: its dtype, its linear weights, the few-token kernel, the fused op."""

    kind: str
    dtype: str
    linear_weights: str
    few_token_kernel: str | None
    fused_layers: bool  # one C++ op per decoder layer, for models with Llama's layer shape

    def describe(self) -> str:
        kernel = self.few_token_kernel or "none"
        return (f"dtype {DTYPE_LABELS.get(self.dtype, self.dtype)}, linear weights {self.linear_weights}, "
                f"few-token kernel {kernel}, fused layer op {'yes' if self.fused_layers else 'no'}")


# One representative flag set per kind (the decisive flags of a CPU of that family), for tests and reports.
KINDS = {
    "amx": CpuKind(frozenset({"avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}),
                   "Intel Xeon (Sapphire Rapids)"),
    "avx512_bf16": CpuKind(frozenset({"avx2", "fma", "avx512f", "avx512_bf16"}), "AMD EPYC (Zen 4)"),
    "avx512": CpuKind(frozenset({"avx2", "fma", "avx512f"}), "Intel Xeon (Cascade Lake)"),
    "avx2": CpuKind(frozenset({"avx2", "fma"}), "AMD EPYC (Zen 3)"),
    "baseline": CpuKind(frozenset(), "no AVX2 (an aarch64 server, an old x86)"),
}


# The -march a build for each kind compiles with (gcc 11 and later), to run a kind's C++ code paths on a machine
# whose instructions include that kind's (`pytest --cpu-kind`).
KIND_MARCH = {"amx": "sapphirerapids", "avx512_bf16": "cooperlake", "avx512": "x86-64-v4", "avx2": "x86-64-v3",
              "baseline": "x86-64-v2"}


def _cpuinfo_field(text: str, field: str) -> str | None:
    for line in text.splitlines():
        if line.startswith(field):
            return line.split(":", 1)[1].strip()
    return None


def this_cpu() -> CpuKind:
    """The CPU this process runs on, from /proc/cpuinfo (no flags where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    flags = _cpuinfo_field(text, "flags") or ""
    return CpuKind(frozenset(flags.split()), _cpuinfo_field(text, "model name") or "")
