"""The engine's process runtime: which dtype a device gets, and the CPU settings that make it fast.

Whatever starts an engine calls `tune_cpu_runtime()` first (the `s3serve` CLI,
each worker actor, the benchmarks), so all of them run the same way:

- torch intra-op threads = the cores this process may use (Ray sets
  OMP_NUM_THREADS=1 in actors, which would leave one core idle);
- glibc keeps freed memory instead of unmapping it: the engine allocates the
  same large temporaries every step (logits, MLP activations), and each fresh
  mmap costs page faults. Measured on SmolLM2, bf16, batch 128: 77 -> 71 ms per
  step, the same gain as preloading tcmalloc, without LD_PRELOAD.

Core binding (OMP_PROC_BIND/OMP_PLACES) was measured and left out: no gain here,
and worker actors share cores with the router and controller.
"""

import ctypes
import logging
import os

from workers.engine import cpu_kind

logger = logging.getLogger(__name__)

DTYPE_NAMES = ("float32", "bfloat16", "float16")
DTYPE_CHOICES = ("auto", *DTYPE_NAMES)

_M_TRIM_THRESHOLD = -1  # glibc mallopt parameters (malloc.h)
_M_MMAP_THRESHOLD = -3
_KEEP_BYTES = 256 * 1024**2


def resolve_dtype(name: str, device, config_dtype: str | None = None):
    """A torch dtype for a dtype name, or "auto": on CUDA the model's own half type (`config_dtype`, its config's
    dtype) where it has one and the GPU runs it, else bf16 (fp16 on GPUs without bf16); on the CPU its kind's
    (`CpuKind.auto_dtype`: bf16 where it has bf16 instructions, fp32 otherwise; fp16 arithmetic on CPUs is slow)."""
    import torch

    if name != "auto":
        if name not in DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {name!r}")
        return getattr(torch, name)
    device_type = torch.device(device).type
    if device_type == "cuda":
        bf16 = torch.cuda.is_bf16_supported()
        if config_dtype == "float16" or not bf16:
            return torch.float16
        return torch.bfloat16
    return getattr(torch, cpu_kind.this_cpu().auto_dtype) if device_type == "cpu" else torch.float32


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


def tune_cpu_runtime(num_threads: int | None = None) -> int:
    """Set torch threads (default: usable cores) and glibc's allocator; returns the thread count. Idempotent."""
    import torch

    threads = num_threads or usable_cores()
    if threads < 1:
        raise ValueError(f"num_threads must be >= 1, got {threads}")
    torch.set_num_threads(threads)
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, _KEEP_BYTES)
        libc.mallopt(_M_TRIM_THRESHOLD, _KEEP_BYTES)
    except (OSError, AttributeError):
        logger.debug("not glibc: allocator left as it is")
    return threads
