"""Architectures other than Llama, through the engine's fast path and its Hugging Face path with our paged attention.

Tiny randomly initialised models built from transformers' own config classes (no download), fp32,
weights redrawn at std 0.2 so that every token depends on its context. Each must answer exactly as
Hugging Face `generate` does, with chunked prefill and preemption, on sequences much longer than
the sliding window where the architecture has one (Mistral, Qwen2's upper layers, Phi-3, Gemma 3's
local layers between global ones).
"""

import copy

import pytest
import torch
from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config

from engine_driver import (ARCHITECTURES, WINDOW, hf_greedy_runner, make_prompt, run_engine, sliding_window,
                           tiny_architecture)
from workers.engine.engine import Engine, EngineConfig
from workers.engine.model_runner import pool_shape_for
from workers.values.sampling_params import SamplingParams


def test_the_sliding_window_is_read_as_the_model_applies_it():
    assert sliding_window(MistralConfig(sliding_window=4096)) == 4096  # Mistral 7B v0.1
    assert sliding_window(MistralConfig(sliding_window=None)) is None  # v0.2 and later
    assert sliding_window(Qwen2Config(sliding_window=64, use_sliding_window=False)) is None  # carried, not used
    gemma3 = Gemma3TextConfig(sliding_window=512)  # sliding and global layers interleaved
    assert "sliding_attention" in gemma3.layer_types and sliding_window(gemma3) == 512
    assert sliding_window(Gemma3TextConfig(sliding_window=512, layer_types=["full_attention"] * 26)) is None
    assert sliding_window(LlamaConfig()) is None


@pytest.mark.parametrize("path", ["fast", "hf"])
@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_greedy_answers_equal_hugging_face_generate(name, path):
    model = tiny_architecture(name)
    expect_window = None if name == "qwen3" else WINDOW
    assert sliding_window(model.config) == expect_window
    hf_greedy = hf_greedy_runner(model)
    prompts = [make_prompt(6 + 3 * i, seed=100 + i) for i in range(8)]
    requests = {f"r{i}": (prompt, SamplingParams(max_tokens=48, ignore_eos=True)) for i, prompt in enumerate(prompts)}
    # 12 blocks of 4 tokens hold fewer than two 64-token sequences: later ones wait, some are preempted
    bytes_per_block = pool_shape_for(model.config, 1, 4, torch.float32).bytes_per_block
    engine = Engine(copy.deepcopy(model), EngineConfig.of(kv_cache_bytes=24 * bytes_per_block, block_size=4,
                                                       max_num_seqs=4, max_num_batched_tokens=8,
                                                       max_model_len=128, use_fast_path=path == "fast"))
    assert engine.runner.path == path
    outputs = run_engine(engine, requests, {0: list(requests)})
    for seq_id, (prompt, params) in requests.items():
        assert list(outputs[seq_id].output_token_ids) == hf_greedy(prompt, params.max_tokens), (name, seq_id)
    assert engine.scheduler.num_preemptions > 0
