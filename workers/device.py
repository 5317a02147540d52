"""Which device a worker's engine runs on, and how much KV it gets there.

    device "auto"  -> "cuda" when CUDA is available and the process may use a GPU (Ray gave the
                      actor one, or it runs outside Ray), else "cpu"
    device "cpu" / "cuda" / "cuda:N" -> itself, refused with a clear error if CUDA is absent
    KV budget      -> kv_cache_bytes, or kv_cache_fraction of the GPU memory free after the
                      model is loaded (CUDA only: on CPU a byte budget is required)

The decisions are pure functions of what they are told (is CUDA there, which GPUs Ray
assigned, how much memory is free), so the config path that would pick CUDA is tested on
CPU; `probe_cuda` and `free_device_bytes` ask torch.
"""

import re

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


def kv_budget_bytes(kv_cache_bytes: int, kv_cache_fraction: float | None, device: str,
                    free_bytes: int | None) -> int:
    """The KV budget: `kv_cache_fraction` of `free_bytes` on CUDA when given, else `kv_cache_bytes`."""
    if kv_cache_fraction is None:
        return kv_cache_bytes
    if not 0.0 < kv_cache_fraction <= 1.0:
        raise ValueError(f"kv_cache_fraction must be in (0, 1], got {kv_cache_fraction}")
    if not device.startswith("cuda") or free_bytes is None:
        raise ValueError(f"kv_cache_fraction sizes the KV cache from free GPU memory; device {device!r} has none "
                         "to measure: give kv_cache_bytes instead")
    return int(free_bytes * kv_cache_fraction)


def probe_cuda() -> tuple[bool, list | None]:
    """(is CUDA available to torch, the GPU ids Ray assigned this process or None outside Ray)."""
    import torch

    try:
        import ray

        gpu_ids = ray.get_gpu_ids() if ray.is_initialized() else None
    except ImportError:  # the engine runs without Ray too (benchmarks, tests)
        gpu_ids = None
    return torch.cuda.is_available(), gpu_ids


def free_device_bytes(device: str) -> int | None:
    """Free memory of a CUDA device in bytes (None for the CPU)."""
    if not device.startswith("cuda"):
        return None
    import torch

    free, _total = torch.cuda.mem_get_info(torch.device(device))
    return int(free)
