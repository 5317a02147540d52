"""Which device a worker's engine runs on, and how much KV it gets there.

    device "auto"  -> "cuda" when CUDA is available and the process may use a GPU (Ray gave the
                      actor one, or it runs outside Ray), else "cpu"
    device "cpu" / "cuda" / "cuda:N" -> itself, refused with a clear error if CUDA is absent
    free memory    -> what the KV budget is sized from (`workers.values.kv_memory`): on CUDA the device's
                      free memory, on the CPU the memory available to this process (the machine's,
                      or its cgroup's limit when that is lower)

The decisions are pure functions of what they are told (is CUDA there, which GPUs Ray
assigned, how much memory is free), so the config path that would pick CUDA is tested on
CPU; `probe_cuda` and `free_memory_bytes` ask torch and the system.
"""

import re
from pathlib import Path

DEVICE_PATTERN = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def check_device(name: str) -> str:
    """`name` if it is auto, cpu, cuda or cuda:N; ValueError otherwise."""
    if not isinstance(name, str) or not DEVICE_PATTERN.match(name):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {name!r}")
    return name


def resolve_device(name: str, cuda_available: bool, assigned_gpu_ids: list | None) -> str:
    """The torch device a worker uses.

    Args:
        name: the setting (see `check_device`).
        cuda_available: whether torch sees a CUDA device in this process.
        assigned_gpu_ids: the GPUs Ray assigned to this actor ([] when it asked for none);
            None outside Ray. Ray sets CUDA_VISIBLE_DEVICES to them, so the actor's GPU is cuda:0.
    """
    check_device(name)
    if name == "auto":
        uses_gpu = cuda_available and (assigned_gpu_ids is None or len(assigned_gpu_ids) > 0)
        return "cuda" if uses_gpu else "cpu"
    if name.startswith("cuda") and not cuda_available:
        raise ValueError(f"device {name!r} was asked for but CUDA is not available in this process "
                         "(no GPU, a CPU-only torch, or the actor was given no GPU: set worker_num_gpus)")
    return name


def probe_cuda() -> tuple[bool, list | None]:
    """(is CUDA available to torch, the GPU ids Ray assigned this process or None outside Ray)."""
    import torch

    try:
        import ray

        gpu_ids = ray.get_gpu_ids() if ray.is_initialized() else None
    except ImportError:  # the engine runs without Ray too (benchmarks, tests)
        gpu_ids = None
    return torch.cuda.is_available(), gpu_ids


def free_memory_bytes(device: str) -> int:
    """Memory free for this process on `device` in bytes: CUDA's free device memory, or on the CPU the memory
    the machine has available, capped by this process's cgroup limit when one is set."""
    if device.startswith("cuda"):
        import torch

        free, _total = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    import psutil

    available = int(psutil.virtual_memory().available)
    limit = cgroup_room_bytes(Path("/sys/fs/cgroup"))
    return available if limit is None else min(available, limit)


def cgroup_room_bytes(root: Path) -> int | None:
    """A cgroup v2 limit minus what the cgroup uses (None when unlimited or not readable)."""
    try:
        limit = (root / "memory.max").read_text().strip()
        used = int((root / "memory.current").read_text().strip())
    except (OSError, ValueError):
        return None
    if limit == "max" or not limit.isdigit():
        return None
    return max(0, int(limit) - used)
