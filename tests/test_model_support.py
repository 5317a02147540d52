"""Models our paged attention would answer wrongly are refused in one line, before any worker starts.

Configs are built from transformers' own config classes (no weights, no download)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import (DeepseekV3Config, Gemma2Config, Gemma3TextConfig, LlamaConfig, MistralConfig, Phi3Config,
                          Qwen2Config, Qwen3Config)

from workers.model_support import check_servable, refusal, sliding_window
from workers.ports import free_port


def test_full_attention_models_are_served():
    for config in (LlamaConfig(), Qwen2Config(), Qwen3Config(), MistralConfig(sliding_window=None)):
        assert sliding_window(config) is None and refusal(config, 32768) is None, type(config).__name__


def test_a_sliding_window_is_refused_only_where_a_sequence_can_outgrow_it():
    mistral = MistralConfig(sliding_window=4096)  # Mistral 7B v0.1
    assert refusal(mistral, 4096) is None  # no sequence is longer than the window: the window never applies
    reason = refusal(mistral, 8192)
    assert "sliding window of 4096 tokens" in reason and "max_model_len <= 4096" in reason
    assert sliding_window(Qwen2Config(sliding_window=64, use_sliding_window=False)) is None  # carried, not used
    gemma3 = Gemma3TextConfig(sliding_window=512)  # sliding and global layers interleaved
    assert "sliding_attention" in gemma3.layer_types and sliding_window(gemma3) == 512
    assert "sliding window of 512" in refusal(gemma3, 2048)
    assert refusal(Gemma3TextConfig(sliding_window=512, layer_types=["full_attention"] * 26), 2048) is None
    assert "sliding window of 2047" in refusal(Phi3Config(sliding_window=2047), 4096)  # Phi-3-mini-4k


def test_what_our_kernels_do_not_implement_is_named():
    assert "attn_logit_softcapping = 50.0" in refusal(Gemma2Config(), 1024)  # before its window
    assert "multi-head latent attention" in refusal(DeepseekV3Config(), 1024)
    remote = LlamaConfig()
    remote.auto_map = {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}
    assert "remote code" in refusal(remote, 1024)
    quantized = LlamaConfig()
    quantized.quantization_config = {"quant_method": "awq", "bits": 4}
    assert "quantized (awq)" in refusal(quantized, 1024)
    with pytest.raises(ValueError, match=r"^cannot serve 'gemma-2' correctly: it caps attention logits"):
        check_servable(Gemma2Config(), 1024, "gemma-2")


def test_the_engine_refuses_a_model_it_would_answer_wrongly():
    import torch
    from transformers import MistralForCausalLM

    from workers.engine import Engine, EngineConfig

    config = MistralConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=16,
                           max_position_embeddings=256)
    torch.manual_seed(0)
    model = MistralForCausalLM(config).eval()
    with pytest.raises(ValueError, match="sliding window of 16 tokens"):
        Engine(model, EngineConfig(kv_cache_bytes=1 << 20, max_model_len=128))
    Engine(model, EngineConfig(kv_cache_bytes=1 << 20, max_model_len=16))  # within the window: served


def test_serve_refuses_it_before_anything_starts(tmp_path):
    folder = tmp_path / "mistral-v0.1-like"
    folder.mkdir()
    config = MistralConfig(sliding_window=16, num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                           num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    (folder / "config.json").write_text(json.dumps(config.to_dict()))
    command = [str(Path(sys.executable).parent / "s3serve"), "serve", "--model", str(folder), "--port",
               str(free_port()), "--data-dir", str(tmp_path / "data"), "--max-model-len", "512"]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"},
                          timeout=120)
    assert done.returncode == 2, done.stderr
    [error] = [line for line in done.stderr.splitlines() if line.startswith("s3serve serve: error:")]
    assert "sliding window of 16 tokens" in error and "max_model_len <= 16" in error, done.stderr
    assert "Traceback" not in done.stderr and "Ray" not in done.stdout  # nothing was started
    missing = subprocess.run([*command[:3], str(tmp_path / "nowhere"), *command[4:]], capture_output=True, text=True,
                             env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=120)
    [error] = [line for line in missing.stderr.splitlines() if line.startswith("s3serve serve: error:")]
    assert missing.returncode == 2 and "is neither" in error and "Ray" not in missing.stdout, missing.stderr
