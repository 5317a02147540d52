"""Models our paged attention would answer wrongly are refused in one line, before any worker starts.

Configs are built from transformers' own config classes (no weights, no download). That the models
we do serve answer as Hugging Face does is `tests/engine/test_architectures.py`."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import (DeepseekV3Config, Gemma2Config, Gemma2ForCausalLM, Gemma3TextConfig, LlamaConfig,
                          MistralConfig, Phi3Config, Qwen2Config, Qwen3Config)

from workers.actors.ports import free_port
from workers.values.model_support import check_servable, refusal


def test_the_architectures_our_attention_implements_are_served():
    for config in (LlamaConfig(), Qwen2Config(), Qwen3Config(), MistralConfig(sliding_window=4096),
                   Phi3Config(sliding_window=2047), Gemma3TextConfig(sliding_window=512)):
        assert refusal(config) is None, type(config).__name__


def test_what_our_kernels_do_not_implement_is_named():
    assert "attn_logit_softcapping = 50.0" in refusal(Gemma2Config())
    assert "multi-head latent attention" in refusal(DeepseekV3Config())
    remote = LlamaConfig()
    remote.auto_map = {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}
    assert "remote code" in refusal(remote)
    quantized = LlamaConfig()
    quantized.quantization_config = {"quant_method": "awq", "bits": 4}
    assert "quantized (awq)" in refusal(quantized)
    with pytest.raises(ValueError, match=r"^cannot serve 'gemma-2' correctly: it caps attention logits"):
        check_servable(Gemma2Config(), "gemma-2")


def _tiny_gemma2() -> Gemma2Config:
    return Gemma2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256)


def test_the_engine_refuses_a_model_it_would_answer_wrongly():
    import torch

    from workers.engine.engine import Engine, EngineConfig

    torch.manual_seed(0)
    model = Gemma2ForCausalLM(_tiny_gemma2()).eval()
    with pytest.raises(ValueError, match="caps attention logits"):
        Engine(model, EngineConfig.of(kv_cache_bytes=1 << 20, max_model_len=128))


def test_serve_refuses_it_before_anything_starts(tmp_path):
    folder = tmp_path / "gemma-2-like"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(_tiny_gemma2().to_dict()))
    command = [str(Path(sys.executable).parent / "s3serve"), "serve", "--model", str(folder), "--port",
               str(free_port()), "--data-dir", str(tmp_path / "data"), "--max-model-len", "512"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2, done.stderr
    [error] = [line for line in done.stderr.splitlines() if line.startswith("s3serve serve: error:")]
    assert "caps attention logits (attn_logit_softcapping = 50.0)" in error, done.stderr
    assert "Traceback" not in done.stderr and "Ray" not in done.stdout  # nothing was started
    missing = subprocess.run([*command[:3], str(tmp_path / "nowhere"), *command[4:]], capture_output=True, text=True,
                             env=env, timeout=120)
    [error] = [line for line in missing.stderr.splitlines() if line.startswith("s3serve serve: error:")]
    assert missing.returncode == 2 and "is neither" in error and "Ray" not in missing.stdout, missing.stderr
