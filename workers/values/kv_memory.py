"""How much memory a worker's KV cache takes (`kv_cache_memory`), parsed when the settings are made and sized once
the worker's model is loaded, on the CPU and on CUDA alike:

    "auto"                          -> CUDA: AUTO_CUDA_SHARE of the device memory free after the model is loaded
                                       (as vLLM's --gpu-memory-utilization 0.9); CPU: room for max_num_seqs
                                       sequences of max_model_len tokens, at most AUTO_CPU_SHARE of the memory
                                       available after the model is loaded (the CPU's KV shares RAM with
                                       everything else on the machine, and each extra block costs RAM, not speed)
    "0.3" (0 < share <= 1)          -> that share of the memory free after the model is loaded
    "512MiB", "4GiB", "2GB", "268435456", 268435456 -> that many bytes

Before any worker starts, `kv_token_room` tells the service how many tokens that budget will hold where it can be
told (the CPU's memory, or a size), which caps the default max_model_len (`cluster.context_length`).

Pure functions of what they are told (the text, the device, its free memory, the model's KV bytes per token), so
every rule is tested without a GPU; `workers.engine.device.free_memory_bytes` measures the memory.
"""

import re
from dataclasses import dataclass

AUTO_CUDA_SHARE = 0.9
AUTO_CPU_SHARE = 0.1
UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
         "t": 1000**4, "tb": 1000**4, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}
_AMOUNT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$", re.IGNORECASE)
EXPECTED = "'auto', a share of free memory in (0, 1] such as 0.3, or a size such as 4GiB, 512MiB or 268435456 (bytes)"


@dataclass(frozen=True, slots=True)
class KvCacheMemory:
    """A parsed `kv_cache_memory`: `num_bytes`, or `share` of the free memory, or neither (auto)."""

    num_bytes: int | None = None
    share: float | None = None

    @property
    def is_auto(self) -> bool:
        return self.num_bytes is None and self.share is None

    def describe(self) -> str:
        if self.num_bytes is not None:
            return f"{self.num_bytes / 2**20:.0f} MiB"
        return "auto" if self.share is None else f"{self.share:g} of the memory free after loading the model"


def parse_kv_cache_memory(value: str | int | float) -> KvCacheMemory:
    """`value` as a `KvCacheMemory` (see the module docstring); ValueError naming what is expected otherwise."""
    if isinstance(value, bool):
        raise ValueError(f"kv_cache_memory must be {EXPECTED}, got {value!r}")
    if isinstance(value, int):
        text = str(value)
    elif isinstance(value, float):
        text = repr(value)
    elif isinstance(value, str):
        text = value
    else:
        raise ValueError(f"kv_cache_memory must be {EXPECTED}, got {value!r}")
    if text.strip().lower() == "auto":
        return KvCacheMemory()
    match = _AMOUNT.match(text)
    if match is None or match.group(2).lower() not in UNITS:
        raise ValueError(f"kv_cache_memory must be {EXPECTED}, got {value!r}")
    number, unit = match.group(1), match.group(2).lower()
    if not unit and float(number) <= 1.0:
        if float(number) <= 0.0:
            raise ValueError(f"kv_cache_memory must be {EXPECTED}, got {value!r} (a share must be above 0)")
        return KvCacheMemory(share=float(number))
    if not unit and "." in number:
        raise ValueError(f"kv_cache_memory must be {EXPECTED}, got {value!r} (a share is at most 1; bytes are whole)")
    return KvCacheMemory(num_bytes=int(float(number) * UNITS[unit]))


def kv_budget_bytes(memory: KvCacheMemory, device: str, free_bytes: int, bytes_per_token: int, max_model_len: int,
                    max_num_seqs: int) -> int:
    """The worker's KV budget in bytes.

    Args:
        memory: the parsed setting.
        device: the worker's torch device ("cpu", "cuda", "cuda:N").
        free_bytes: memory free on that device after the model is loaded (`workers.engine.device.free_memory_bytes`).
        bytes_per_token: KV bytes one token takes across every layer (on this rank).
        max_model_len: longest sequence in tokens; max_num_seqs: most sequences at once (the CPU's auto room).
    """
    if memory.num_bytes is not None:
        return memory.num_bytes
    if memory.share is not None:
        budget = int(free_bytes * memory.share)
    elif device.startswith("cuda"):
        budget = int(free_bytes * AUTO_CUDA_SHARE)
    else:
        budget = min(max_num_seqs * max_model_len * bytes_per_token, int(free_bytes * AUTO_CPU_SHARE))
    if budget < bytes_per_token:
        raise ValueError(f"kv_cache_memory {memory.describe()}: {free_bytes / 2**20:.0f} MiB are free on {device} "
                         f"after loading the model, no room for one token's KV ({bytes_per_token} bytes): "
                         "give kv_cache_memory in bytes or free memory")
    return budget


def kv_token_room(memory: KvCacheMemory, on_cpu: bool, free_bytes: int, bytes_per_token: int) -> int | None:
    """Most tokens one worker's KV cache will hold, as far as it can be told before the worker starts; None where it
    cannot (a share or auto on CUDA: the GPU's free memory is measured on the worker).

    Args:
        memory: the parsed setting.
        on_cpu: whether the workers run on the CPU.
        free_bytes: on the CPU, the memory a worker will find available once its model is loaded.
        bytes_per_token: KV bytes one token takes across every layer (on one rank).
    On the CPU auto's room grows with max_model_len until AUTO_CPU_SHARE of the memory binds, so that share is the
    room a default max_model_len may take.
    """
    if memory.num_bytes is not None:
        return memory.num_bytes // bytes_per_token
    if not on_cpu:
        return None
    share = AUTO_CPU_SHARE if memory.share is None else memory.share
    return int(free_bytes * share) // bytes_per_token
