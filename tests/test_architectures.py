"""Architectures other than Llama, through the engine's Hugging Face path with our paged attention.

Tiny randomly initialised models built from transformers' own config classes (no download), fp32,
weights redrawn at std 0.2 so that every token depends on its context. Each must answer exactly as
Hugging Face `generate` does, with chunked prefill and preemption, on sequences much longer than
the sliding window where the architecture has one (Mistral, Qwen2's upper layers, Phi-3, Gemma 3's
local layers between global ones).
"""

import copy

import pytest
import torch
from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, MistralConfig, MistralForCausalLM,
                          Phi3Config, Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

from engine_driver import hf_greedy_runner, make_prompt, run_engine, sliding_window
from workers.engine import Engine, EngineConfig
from workers.model_runner import pool_shape_for
from workers.models import redraw_matrices
from workers.sampling_params import SamplingParams

WINDOW = 8  # tokens; prompts and answers run well past it
SHAPE = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}

ARCHITECTURES = {
    "mistral": (MistralForCausalLM, lambda: MistralConfig(**SHAPE, sliding_window=WINDOW)),
    "qwen2": (Qwen2ForCausalLM, lambda: Qwen2Config(**SHAPE, use_sliding_window=True, sliding_window=WINDOW,
                                                    max_window_layers=1)),  # layer 0 global, layer 1 sliding
    "qwen3": (Qwen3ForCausalLM, lambda: Qwen3Config(**SHAPE, head_dim=16)),  # QK norm
    "phi3": (Phi3ForCausalLM, lambda: Phi3Config(**SHAPE, sliding_window=WINDOW, pad_token_id=0)),
    "gemma3": (Gemma3ForCausalLM, lambda: Gemma3TextConfig(
        **SHAPE, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=16, pad_token_id=0,
        layer_types=["sliding_attention", "full_attention"])),
}


def _model(name: str, seed: int = 0) -> torch.nn.Module:
    model_cls, make_config = ARCHITECTURES[name]
    torch.manual_seed(seed)
    model = model_cls(make_config()).eval()
    redraw_matrices(model, seed, 0.2)
    model.generation_config.eos_token_id = None  # generate runs all 48 tokens, as the engine with ignore_eos
    return model


def test_the_sliding_window_is_read_as_the_model_applies_it():
    assert sliding_window(MistralConfig(sliding_window=4096)) == 4096  # Mistral 7B v0.1
    assert sliding_window(MistralConfig(sliding_window=None)) is None  # v0.2 and later
    assert sliding_window(Qwen2Config(sliding_window=64, use_sliding_window=False)) is None  # carried, not used
    gemma3 = Gemma3TextConfig(sliding_window=512)  # sliding and global layers interleaved
    assert "sliding_attention" in gemma3.layer_types and sliding_window(gemma3) == 512
    assert sliding_window(Gemma3TextConfig(sliding_window=512, layer_types=["full_attention"] * 26)) is None
    assert sliding_window(LlamaConfig()) is None


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_greedy_answers_equal_hugging_face_generate(name):
    model = _model(name)
    expect_window = None if name == "qwen3" else WINDOW
    assert sliding_window(model.config) == expect_window
    hf_greedy = hf_greedy_runner(model)
    prompts = [make_prompt(6 + 3 * i, seed=100 + i) for i in range(8)]
    requests = {f"r{i}": (prompt, SamplingParams(max_tokens=48, ignore_eos=True)) for i, prompt in enumerate(prompts)}
    # 12 blocks of 4 tokens hold fewer than two 64-token sequences: later ones wait, some are preempted
    bytes_per_block = pool_shape_for(model.config, 1, 4, torch.float32).bytes_per_block
    engine = Engine(copy.deepcopy(model), EngineConfig(kv_cache_bytes=24 * bytes_per_block, block_size=4,
                                                       max_num_seqs=4, max_num_batched_tokens=8,
                                                       max_model_len=128))
    assert engine.runner.path == "hf"
    outputs = run_engine(engine, requests, {0: list(requests)})
    for seq_id, (prompt, params) in requests.items():
        assert list(outputs[seq_id].output_token_ids) == hf_greedy(prompt, params.max_tokens), (name, seq_id)
    assert engine.scheduler.num_preemptions > 0
