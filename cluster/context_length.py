"""The service's max_model_len when none is configured: the model's own limit, capped by the KV memory a worker gets.

    max_model_len set            -> itself
    not set (the default)        -> the model's max_position_embeddings (its text config's, for a multimodal
                                    config), capped at the tokens one worker's KV cache will hold where that is
                                    known before any worker starts (`workers.values.kv_memory.kv_token_room`:
                                    on the CPU, or a size given in bytes); on GPUs with a share or auto the
                                    worker measures its memory, and the start-up line says how many such
                                    sequences fit

as vLLM defaults --max-model-len to the model's limit and SGLang's --context-length to the config's. Resolved once,
where the service is built (`s3serve serve` and `cluster.app.build_app`), so the routers, the controller and every
worker see one number.
"""

from pathlib import Path

from cluster.config import ServiceConfig
from workers.engine.device import free_memory_bytes
from workers.values.kv_memory import kv_token_room, parse_kv_cache_memory


def default_max_model_len(model_limit: int, room_tokens: int | None) -> int:
    """The model's limit, or the KV room when that is smaller and known."""
    return model_limit if room_tokens is None else min(model_limit, room_tokens)


def workers_on_cpu(config: ServiceConfig) -> bool:
    """Whether the workers will run on the CPU: asked for, or auto with no GPU per worker (Ray gives auto a GPU
    only through worker_num_gpus)."""
    return config.device == "cpu" or (config.device == "auto" and config.worker_num_gpus == 0)


def kv_bytes_per_token(text_config, dtype, tensor_parallel_size: int) -> int:
    """KV bytes one token takes on one rank (K and V of every layer, 1/tp of the KV heads), as the worker's block pool
    lays them out (`workers.engine.model_runner.pool_shape_for`, a block of one token); `dtype` a torch dtype."""
    from workers.engine.model_runner import pool_shape_for

    return pool_shape_for(text_config, 1, 1, dtype, tensor_parallel_size).bytes_per_block


def weight_bytes(model_dir: Path) -> int:
    """Bytes of the model's weight files (what a worker's load takes from the memory it then measures)."""
    return sum(path.stat().st_size for pattern in ("*.safetensors", "*.bin") for path in Path(model_dir).glob(pattern))


def resolve_max_model_len(config: ServiceConfig) -> tuple[ServiceConfig, str]:
    """`config` with max_model_len set, and where the number came from (for the start-up line). ValueError when the
    result leaves no room for default_max_tokens."""
    if config.max_model_len is not None:
        return config, "configured"
    import torch
    from transformers import AutoConfig

    from workers.engine.models import config_dtype, resolve_model_dir
    from workers.engine.runtime import resolve_dtype

    cache_dir = Path(config.model_cache_dir) if config.model_cache_dir else None
    model_dir = resolve_model_dir(config.model, cache_dir, config.revision)
    text_config = AutoConfig.from_pretrained(model_dir).get_text_config()
    model_limit = int(text_config.max_position_embeddings)
    on_cpu = workers_on_cpu(config)
    memory = parse_kv_cache_memory(config.kv_cache_memory)
    room = None
    if on_cpu or memory.num_bytes is not None:
        if on_cpu:
            dtype = resolve_dtype(config.dtype, "cpu", config_dtype(model_dir))
        else:  # auto on a GPU is a half type
            dtype = torch.float32 if config.dtype == "float32" else torch.float16
        per_token = kv_bytes_per_token(text_config, dtype, config.tensor_parallel_size)
        free = max(0, free_memory_bytes("cpu") - weight_bytes(model_dir)) if on_cpu else 0
        room = kv_token_room(memory, on_cpu, free, per_token)
    value = default_max_model_len(model_limit, room)
    source = ("the model's max_position_embeddings" if value == model_limit
              else f"capped from the model's {model_limit:,} at what one worker's KV cache holds")
    if config.default_max_tokens is not None and value <= config.default_max_tokens:
        raise ValueError(f"max_model_len would be {value:,} ({source}), not above default_max_tokens "
                         f"{config.default_max_tokens}: raise kv_cache_memory, or set max_model_len and "
                         "default_max_tokens")
    return config.model_copy(update={"max_model_len": value}), source
