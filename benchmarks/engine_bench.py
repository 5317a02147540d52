"""`s3serve bench engine`: continuous batching vs Hugging Face `generate` in static batches.

Both sides run the same fp32 model in the same process on the same prompts
with greedy decoding, stopping at EOS or `max_tokens`. The engine keeps up to
`batch_size` sequences running and admits the next prompt as soon as one
finishes; `generate` runs left-padded batches of `batch_size` until the
longest member is done. Tokens/s counts generated tokens up to and including
EOS on both sides, so padding after EOS is not counted as work done.
"""

import copy
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from benchmarks.prompt_pool import DEFAULT_PROMPTS, encode_chat, read_prompts, spread_sample
from benchmarks.report import environment, format_table, write_json
from workers.engine import Engine, EngineConfig
from workers.models import DEFAULT_MODEL, load_model, load_tokenizer, resolve_model_dir
from workers.sampling import SamplingParams


@dataclass(frozen=True, slots=True)
class EngineBenchConfig:
    """What `bench engine` runs.

    Attributes:
        prompts_path: JSONL prompt file.
        num_prompts: prompts, sampled evenly across the file.
        batch_sizes: engine max_num_seqs and HF batch size, one run each.
        max_tokens: generation limit per prompt.
        max_prompt_tokens: prompts longer than this are skipped.
        kv_cache_bytes: engine KV budget (ample: this compares batching, not memory).
        primary_batch_size: the batch size whose numbers are reported at top level.
    """

    prompts_path: Path = DEFAULT_PROMPTS
    num_prompts: int = 32
    batch_sizes: tuple[int, ...] = (16,)
    max_tokens: int = 256
    max_prompt_tokens: int = 512
    kv_cache_bytes: int = 2 * 1024**3
    primary_batch_size: int = 16


def quick_config(prompts_path: Path) -> EngineBenchConfig:
    return EngineBenchConfig(prompts_path=prompts_path, num_prompts=32, batch_sizes=(16,), max_tokens=256)


def full_config(prompts_path: Path) -> EngineBenchConfig:
    return EngineBenchConfig(prompts_path=prompts_path, num_prompts=96, batch_sizes=(1, 4, 16, 64), max_tokens=256)


def run_engine(engine: Engine, prompts: list[list[int]], params: SamplingParams, progress: tqdm) -> tuple[list[list[int]], float]:
    """Generate all prompts through the engine; returns outputs in prompt order and seconds taken."""
    start_s = time.perf_counter()
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.is_finished:
                outputs[out.seq_id] = list(out.output_token_ids)
                progress.update(1)
    return [outputs[seq_id] for seq_id in ids], time.perf_counter() - start_s


def run_hf_static(model, prompts: list[list[int]], batch_size: int, max_tokens: int, pad_token_id: int,
                  eos_token_ids: set[int], progress: tqdm) -> tuple[list[list[int]], float]:
    """HF `generate` in left-padded static batches; outputs cut after the first EOS."""
    outputs: list[list[int]] = []
    start_s = time.perf_counter()
    for first in range(0, len(prompts), batch_size):
        batch = prompts[first: first + batch_size]
        width = max(len(p) for p in batch)
        input_ids = torch.tensor([[pad_token_id] * (width - len(p)) + p for p in batch])  # [B, width]
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            generated = model.generate(
                input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_tokens,
                do_sample=False, pad_token_id=pad_token_id,
            )
        for row in generated[:, width:].tolist():
            cut = next((i + 1 for i, token in enumerate(row) if token in eos_token_ids), len(row))
            outputs.append(row[:cut])
        progress.update(len(batch))
    return outputs, time.perf_counter() - start_s


def run(config: EngineBenchConfig, model_name: str = DEFAULT_MODEL, model_cache_dir: Path | None = None,
        json_path: Path | None = None) -> dict:
    """Run every batch size, print the table, write JSON, return the result."""
    model_dir = resolve_model_dir(model_name, model_cache_dir)
    tokenizer = load_tokenizer(model_dir)
    records = spread_sample(read_prompts(config.prompts_path), config.num_prompts * 2)
    prompts = [ids for ids in (encode_chat(tokenizer, r, config.max_prompt_tokens) for r in records) if ids]
    prompts = prompts[: config.num_prompts]
    hf_model = load_model(model_dir)
    engine_model = copy.deepcopy(hf_model)
    eos_ids = set(hf_model.generation_config.eos_token_id if isinstance(hf_model.generation_config.eos_token_id, list)
                  else [hf_model.generation_config.eos_token_id])
    params = SamplingParams(max_tokens=config.max_tokens)
    max_len = max(len(p) for p in prompts) + config.max_tokens
    runs = []
    for batch_size in config.batch_sizes:
        engine = Engine(
            engine_model,
            EngineConfig(kv_cache_bytes=config.kv_cache_bytes, max_num_seqs=batch_size,
                         max_num_batched_tokens=max(512, batch_size), max_model_len=max(max_len, 2048)),
        )
        with tqdm(total=len(prompts), desc=f"engine  batch {batch_size}", unit="prompt") as bar:
            engine_out, engine_s = run_engine(engine, prompts, params, bar)
        with tqdm(total=len(prompts), desc=f"hf      batch {batch_size}", unit="prompt") as bar:
            hf_out, hf_s = run_hf_static(hf_model, prompts, batch_size, config.max_tokens,
                                         tokenizer.pad_token_id, eos_ids, bar)
        engine_tokens = sum(len(o) for o in engine_out)
        hf_tokens = sum(len(o) for o in hf_out)
        lengths = [len(o) for o in engine_out]
        runs.append({
            "batch_size": batch_size,
            "greedy_match": sum(e == h for e, h in zip(engine_out, hf_out)),
            "num_prompts": len(prompts),
            "engine_tokens": engine_tokens,
            "engine_s": engine_s,
            "engine_tokens_per_s": engine_tokens / engine_s,
            "engine_steps": engine.num_steps,
            "hf_tokens": hf_tokens,
            "hf_s": hf_s,
            "hf_generate_tokens_per_s": hf_tokens / hf_s,
            "speedup_vs_hf": (engine_tokens / engine_s) / (hf_tokens / hf_s),
            "mean_output_tokens": sum(lengths) / len(lengths),
            "max_output_tokens": max(lengths),
            "mean_prompt_tokens": sum(len(p) for p in prompts) / len(prompts),
        })
        del engine
    primary = next((r for r in runs if r["batch_size"] == config.primary_batch_size), runs[-1])
    result = {
        "benchmark": "engine",
        "model": model_name,
        "dtype": "float32",
        "prompts_path": str(config.prompts_path),
        "max_tokens": config.max_tokens,
        **{k: primary[k] for k in ("batch_size", "greedy_match", "num_prompts", "engine_tokens_per_s",
                                   "hf_generate_tokens_per_s", "speedup_vs_hf")},
        "runs": runs,
        "environment": environment(),
    }
    headers = ["batch", "prompts", "greedy_match", "mean_out", "max_out", "engine_tok/s", "hf_tok/s", "speedup"]
    rows = [[r["batch_size"], r["num_prompts"], r["greedy_match"], r["mean_output_tokens"], r["max_output_tokens"],
             r["engine_tokens_per_s"], r["hf_generate_tokens_per_s"], r["speedup_vs_hf"]] for r in runs]
    print(format_table(headers, rows))
    write_json(json_path, result)
    return result
