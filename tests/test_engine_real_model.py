"""The engine against Hugging Face `generate` on the real SmolLM2-135M-Instruct (fp32)."""

import copy
import json
import subprocess
import sys

import pytest
import torch

from benchmarks.prompt_pool import encode_chat, read_prompts, spread_sample
from workers.engine import Engine, EngineConfig
from workers.models import load_model
from workers.sampling import SamplingParams

pytestmark = pytest.mark.slow


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy `generate` of one unpadded prompt, stopping at EOS or max_new_tokens."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


def test_greedy_matches_hf_generate_with_sequences_joining_and_leaving(smollm2_dir, smollm2_tokenizer, shared_data):
    records = spread_sample(read_prompts(shared_data / "prompts" / "pool.jsonl"), 40)
    candidates = [ids for ids in (encode_chat(smollm2_tokenizer, r, 200) for r in records) if ids]
    hf_model = load_model(smollm2_dir)
    # Keep prompts whose answer runs to the full 64+ tokens, with different
    # limits so sequences leave the batch at different steps.
    prompts, num_tokens, expected = [], [], []
    for prompt in candidates:
        limit = 64 + 4 * len(prompts)
        output = hf_greedy(hf_model, prompt, limit)
        if len(output) == limit:
            prompts.append(prompt)
            num_tokens.append(limit)
            expected.append(output)
        if len(prompts) == 12:
            break
    assert len(prompts) == 12, "the prompt pool should hold 12 prompts with 64+ token answers"

    engine = Engine(
        copy.deepcopy(hf_model),
        # 4 running at most and 64-token prefill chunks: prompts are prefilled in
        # pieces next to decodes, and waiting prompts join as others finish.
        EngineConfig(kv_cache_bytes=64 * 1024**2, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=1024),
    )
    outputs: dict[str, list[int]] = {}
    ids = []
    for prompt, n in zip(prompts[:6], num_tokens[:6]):
        ids.append(engine.add_request(prompt, SamplingParams(max_tokens=n)))
    for _ in range(20):  # the rest arrives mid-flight
        for out in engine.step():
            if out.is_finished:
                outputs[out.seq_id] = list(out.output_token_ids)
    assert engine.num_running > 0
    for prompt, n in zip(prompts[6:], num_tokens[6:]):
        ids.append(engine.add_request(prompt, SamplingParams(max_tokens=n)))
    while engine.has_unfinished():
        for out in engine.step():
            if out.is_finished:
                outputs[out.seq_id] = list(out.output_token_ids)

    mismatched = [i for i, seq_id in enumerate(ids) if outputs[seq_id] != expected[i]]
    assert mismatched == []
    assert engine.allocator.num_free_blocks == engine.allocator.num_blocks


def test_bench_engine_cli_writes_table_and_json(tmp_path, model_cache_dir, shared_data):
    out_json = tmp_path / "out.json"
    result = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "bench", "engine", "--num-prompts", "4", "--batch-sizes", "2",
         "--max-tokens", "12", "--prompts", str(shared_data / "prompts" / "pool.jsonl"),
         "--model-cache-dir", str(model_cache_dir), "--json", str(out_json)],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "engine_tok/s" in result.stdout and "speedup" in result.stdout
    data = json.loads(out_json.read_text())
    assert data["num_prompts"] == 4
    assert data["greedy_match"] == 4
    for key in ("engine_tokens_per_s", "hf_generate_tokens_per_s", "speedup_vs_hf"):
        assert data[key] > 0
    assert data["runs"][0]["batch_size"] == 2


def test_bench_engine_reports_a_missing_prompt_file_in_one_line(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "bench", "engine", "--prompts", str(tmp_path / "nope.jsonl")],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 2
    assert "nope.jsonl" in result.stderr and "error" in result.stderr
