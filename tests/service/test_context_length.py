"""The service's default max_model_len: the model's own limit, capped by the KV room known at start."""

import pytest
import torch
from transformers import Gemma3TextConfig

from cluster.config import ServiceConfig
from cluster.context_length import (default_max_model_len, kv_bytes_per_token, resolve_max_model_len,
                                    workers_on_cpu)
from workers.engine.models import tiny_llama_config
from workers.scheduling.policies import length_range_tokens, make_policy
from workers.scheduling.s3_policy import BUCKET_RANGE_TOKENS


def test_the_models_limit_unless_the_kv_room_is_smaller():
    assert default_max_model_len(8192, 93_206) == 8192
    assert default_max_model_len(32768, 20_000) == 20_000
    assert default_max_model_len(8192, None) == 8192  # a GPU's room is measured on the worker


def test_workers_run_on_the_cpu_unless_given_gpus():
    assert workers_on_cpu(ServiceConfig())
    assert workers_on_cpu(ServiceConfig(device="cpu", worker_num_gpus=1))
    assert not workers_on_cpu(ServiceConfig(worker_num_gpus=1))
    assert not workers_on_cpu(ServiceConfig(device="cuda"))


def test_kv_bytes_per_token_count_k_and_v_of_every_layer_on_one_rank():
    gemma = Gemma3TextConfig(num_hidden_layers=18, num_key_value_heads=1, head_dim=256)
    assert kv_bytes_per_token(gemma, torch.bfloat16, 1) == 2 * 18 * 1 * 256 * 2  # 18,432: Gemma 3 270M in bf16
    smollm2_like = tiny_llama_config()
    smollm2_like.num_hidden_layers, smollm2_like.num_key_value_heads, smollm2_like.head_dim = 30, 3, 64
    assert kv_bytes_per_token(smollm2_like, torch.bfloat16, 1) == 23040
    smollm2_like.num_key_value_heads = 4
    assert kv_bytes_per_token(smollm2_like, torch.float32, 2) == 2 * 30 * 2 * 64 * 4


@pytest.fixture
def model_dir(tmp_path):
    tiny_llama_config(max_position_embeddings=4096).save_pretrained(tmp_path)  # 2 layers x 2 KV heads x 16
    return tmp_path


def test_a_configured_max_model_len_is_kept(model_dir):
    config = ServiceConfig(model=str(model_dir), max_model_len=1000)
    assert resolve_max_model_len(config) == (config, "configured")


def test_unset_it_is_the_models_limit_or_what_the_kv_cache_holds(model_dir):
    resolved, source = resolve_max_model_len(ServiceConfig(model=str(model_dir), dtype="float32"))
    assert resolved.max_model_len == 4096 and source == "the model's max_position_embeddings"
    per_token = 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads, head_dim 16, fp32: 512 bytes
    small = ServiceConfig(model=str(model_dir), dtype="float32", kv_cache_memory=str(1000 * per_token))
    resolved, source = resolve_max_model_len(small)
    assert resolved.max_model_len == 1000 and "capped from the model's 4,096" in source
    # a GPU worker with bytes given: the same room, the GPU's half type
    gpu = ServiceConfig(model=str(model_dir), worker_num_gpus=1, kv_cache_memory=str(1000 * per_token))
    assert resolve_max_model_len(gpu)[0].max_model_len == 2000
    assert resolve_max_model_len(ServiceConfig(model=str(model_dir), worker_num_gpus=1))[0].max_model_len == 4096


def test_too_little_room_for_default_max_tokens_is_a_clear_error(model_dir):
    config = ServiceConfig(model=str(model_dir), dtype="float32", kv_cache_memory=str(200 * 512),
                           default_max_tokens=256)
    with pytest.raises(ValueError, match="max_model_len would be 200 .* not above default_max_tokens 256"):
        resolve_max_model_len(config)


def test_a_long_context_does_not_widen_the_s3_buckets():
    assert length_range_tokens(1000) == 1000 and length_range_tokens(32768) == BUCKET_RANGE_TOKENS == 2048
    assert make_policy("s3", max_model_len=1000).bucket_tokens == 100
    assert make_policy("s3_peak", max_model_len=32768).bucket_tokens == make_policy("s3", max_model_len=2048).bucket_tokens
