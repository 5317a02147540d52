"""`s3serve bench engine`: where an engine step's time goes, and the engine against Hugging Face `generate`.

Two parts, same model and dtype (default: auto, bf16 where the CPU has bf16 instructions):

1. Step profile. For each batch size, that many pool prompts (cut to
   `profile_prompt_tokens`) are prefilled, then `profile_steps` decode steps are
   timed with the engine's own per-phase clocks: model (the forward without
   attention), attention, scheduling, input building and sampling, in ms per step,
   and tokens/s = batch / step time. At batch 1, 16 and 64 the same steps again with
   structured output on every sequence (a JSON schema, llguidance's masks): the
   step times, the mask's cost and structured over plain tokens/s.
2. Throughput against HF `generate` in left-padded static batches of the same
   size, greedy, stopping at EOS or `max_tokens`; tokens/s counts generated
   tokens up to and including EOS on both sides. Greedy agreement is reported:
   exact in fp32 (the tests hold it there); in bf16, and in fp32 over bf16
   weights (dtype auto on AVX2-only CPUs, both sides over the same weights),
   the two forwards round or sum differently and a near-tie can flip a token.
3. Roofline (`benchmarks/roofline.py`): this machine's read bandwidth and peak
   matmul throughput in the engine's dtype, measured once; for each profiled batch
   size, the bytes and FLOPs a decode step must move, what the engine achieved, which
   limit binds and the share of it reached (the step's floor over its time).
"""

import copy
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from benchmarks.prompt_pool import DEFAULT_PROMPTS, encode_chat, read_prompts, spread_sample
from benchmarks.report import environment, format_table, write_json
from benchmarks.roofline import DecoderShape, Limits, decode_step_cost, measure_limits, run_cost
from cluster.config import service_default
from workers.engine.engine import Engine
from workers.engine.model_runner import pool_shape_for
from workers.engine.linear_weights import as_served, has_bf16_linear_weights
from workers.engine.models import DEFAULT_MODEL, load_model, load_tokenizer, resolve_model_dir
from workers.engine.runtime import resolve_dtype
from workers.scheduling.engine_config import EngineConfig
from workers.values.sampling_params import GrammarSpec, SamplingParams


@dataclass(frozen=True, slots=True)
class EngineBenchConfig:
    """What `bench engine` runs.

    Attributes:
        prompts_path: JSONL prompt file.
        num_prompts: prompts of the HF comparison, sampled evenly across the file.
        batch_sizes: engine max_num_seqs and HF batch size of the comparison, one run each.
        max_tokens: generation limit per prompt (comparison).
        max_prompt_tokens: prompts longer than this are skipped (comparison).
        kv_cache_bytes: engine KV budget (ample: this measures the engine, not memory).
        primary_batch_size: the batch size whose numbers are reported at top level.
        dtype: "auto", "float32" or "bfloat16"; both sides use it.
        profile_batch_sizes: batch sizes of the step profile.
        profile_steps: decode steps timed per batch size.
        profile_prompt_tokens: prompt length of the profile's sequences.
    """

    prompts_path: Path = DEFAULT_PROMPTS
    num_prompts: int = 32
    batch_sizes: tuple[int, ...] = (16,)
    max_tokens: int = 256
    max_prompt_tokens: int = 512
    kv_cache_bytes: int = 2 * 1024**3
    primary_batch_size: int = 16
    dtype: str = service_default("dtype")
    profile_batch_sizes: tuple[int, ...] = (1, 16, 64, 128)
    profile_steps: int = 16
    profile_prompt_tokens: int = 64


def quick_config(prompts_path: Path) -> EngineBenchConfig:
    return EngineBenchConfig(prompts_path=prompts_path, num_prompts=32, batch_sizes=(16,), max_tokens=256)


def full_config(prompts_path: Path) -> EngineBenchConfig:
    return EngineBenchConfig(prompts_path=prompts_path, num_prompts=96, batch_sizes=(1, 4, 16, 64), max_tokens=256,
                             profile_batch_sizes=(1, 16, 64, 128, 256), profile_steps=32)


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


PHASES = ("model", "attention", "schedule", "inputs", "sample", "other")


# Structured output's line: a JSON array of at least 50 small objects (it cannot end within the profile's steps,
# so every sequence stays in the batch), against the same steps unconstrained.
STRUCTURED_BATCH_SIZES = (1, 16, 64)
STRUCTURED_SCHEMA = {"type": "array", "minItems": 50, "items": {
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}},
    "required": ["name", "n"], "additionalProperties": False}}


def profile_steps(model, prompt_stream: list[int], batch_size: int, config: EngineBenchConfig,
                  tokenizer=None, grammar: GrammarSpec | None = None) -> dict:
    """Decode-step time of `batch_size` running sequences, split by phase (ms per step); with `grammar`, every
    sequence constrained by it (the engine then needs the tokenizer)."""
    engine = Engine(model, EngineConfig.of(kv_cache_bytes=config.kv_cache_bytes, max_num_seqs=batch_size,
                                        max_num_batched_tokens=max(512, batch_size), max_model_len=2048),
                    tokenizer=tokenizer)
    length = config.profile_prompt_tokens
    params = SamplingParams(max_tokens=config.profile_steps + 64, ignore_eos=True, grammar=grammar)
    for index in range(batch_size):
        start = (index * 7919) % max(1, len(prompt_stream) - length)
        engine.add_request(prompt_stream[start:start + length], params)
    while engine.scheduler.waiting or any(s.num_output_tokens == 0 for s in engine.scheduler.running):
        engine.step()  # prefill everyone
    for _ in range(2):
        engine.step()  # warm-up decodes
    # each sequence's context at the middle of the timed steps: the mean step's attention reads
    mid_contexts = [s.num_tokens + (config.profile_steps - 1) / 2 for s in engine.scheduler.running]
    totals = dict.fromkeys(PHASES, 0.0)
    start_s = time.perf_counter()
    for _ in range(config.profile_steps):
        step_start_s = time.perf_counter()
        engine.step()
        step_s = time.perf_counter() - step_start_s
        t = engine.last_times
        phases = {"model": t.forward_s - t.attention_s, "attention": t.attention_s,
                  "schedule": t.schedule_s + t.postprocess_s, "inputs": t.prepare_s, "sample": t.sample_s}
        phases["other"] = max(0.0, step_s - sum(phases.values()))
        for phase, seconds in phases.items():
            totals[phase] += seconds
    elapsed_s = time.perf_counter() - start_s
    step_ms = elapsed_s / config.profile_steps * 1e3
    contexts = [s.num_tokens for s in engine.scheduler.running]
    result = {"batch_size": batch_size, "step_ms": step_ms, "tokens_per_s": batch_size / step_ms * 1e3,
              "context_tokens_min": min(contexts), "context_tokens_max": max(contexts), "path": engine.runner.path,
              "mid_contexts": mid_contexts}
    result.update({f"{phase}_ms": totals[phase] / config.profile_steps * 1e3 for phase in PHASES})
    return result


def decoder_shape(model, dtype) -> DecoderShape:
    """The model's decode-step shape in `dtype` (weights and KV both in it; the weights in bf16 where the model's
    linears read bf16 weights, `workers.engine.linear_weights`)."""
    element_bytes = 2 if has_bf16_linear_weights(model) else torch.tensor([], dtype=dtype).element_size()
    total_params = sum(p.numel() for p in model.parameters())  # a tied head counted once
    return DecoderShape.of(model.config, total_params, element_bytes,
                           pool_shape_for(model.config, 1, 1, dtype).bytes_per_block)


def roofline_lines(profile: list[dict], shape: DecoderShape, limits: Limits) -> list[dict]:
    """Per profiled batch size: the mean timed step's cost judged against the limits (takes the profile rows'
    mid_contexts out)."""
    rows = []
    for p in profile:
        cost = decode_step_cost(shape, p.pop("mid_contexts"))
        judged = limits.judge(cost, p["step_ms"] / 1e3)
        p["share_of_limit"] = judged["share_of_limit"]
        rows.append({"batch_size": p["batch_size"], "step_ms": p["step_ms"], "bytes_per_step": cost.bytes,
                     "flops_per_step": cost.flops, **judged})
    return rows


def structured_lines(plain: list[dict], structured: list[dict]) -> list[dict]:
    """Per batch size: both step times, the mask's cost (the sample phase's growth plus the schedule phase's,
    where tokens are consumed) and structured over plain tokens/s."""
    by_batch = {p["batch_size"]: p for p in plain}
    rows = []
    for row in structured:
        twin = by_batch[row["batch_size"]]
        rows.append({"batch_size": row["batch_size"], "plain_step_ms": twin["step_ms"],
                     "structured_step_ms": row["step_ms"],
                     "mask_ms": row["sample_ms"] + row["schedule_ms"] - twin["sample_ms"] - twin["schedule_ms"],
                     "tokens_per_s_ratio": row["tokens_per_s"] / twin["tokens_per_s"]})
    return rows


def run(config: EngineBenchConfig, model_name: str = DEFAULT_MODEL, model_cache_dir: Path | None = None,
        json_path: Path | None = None) -> dict:
    """Profile steps, compare with HF, print tables, write JSON, return the result."""
    dtype = resolve_dtype(config.dtype, "cpu")
    dtype_name = str(dtype).removeprefix("torch.")
    model_dir = resolve_model_dir(model_name, model_cache_dir)
    tokenizer = load_tokenizer(model_dir)
    records = spread_sample(read_prompts(config.prompts_path), config.num_prompts * 2)
    prompts = [ids for ids in (encode_chat(tokenizer, r, config.max_prompt_tokens) for r in records) if ids]
    prompts = prompts[: config.num_prompts]
    hf_model = as_served(load_model(model_dir, dtype=dtype), "cpu", config.dtype)
    if has_bf16_linear_weights(hf_model):  # dtype auto on an AVX2-only CPU: both sides over the bf16 weights
        dtype_name = "float32 over bf16 weights"
    engine_model = copy.deepcopy(hf_model)
    print(f"model {model_name}, {dtype_name}, {torch.get_num_threads()} torch threads")

    stream = [token for prompt in prompts for token in prompt]
    profile, structured = [], []
    grammar = GrammarSpec("json_schema", json.dumps(STRUCTURED_SCHEMA))
    for batch_size in tqdm(config.profile_batch_sizes, desc="step profile", unit="batch size"):
        profile.append(profile_steps(engine_model, stream, batch_size, config))
        if batch_size in STRUCTURED_BATCH_SIZES:  # right after its plain twin: the same prompts and steps
            structured.append(profile_steps(engine_model, stream, batch_size, config, tokenizer, grammar))
    print(format_table(
        ["batch", "step_ms", "model", "attention", "schedule", "inputs", "sample", "other", "tok/s", "context"],
        [[p["batch_size"], p["step_ms"], p["model_ms"], p["attention_ms"], p["schedule_ms"], p["inputs_ms"],
          p["sample_ms"], p["other_ms"], p["tokens_per_s"], f"{p['context_tokens_min']}-{p['context_tokens_max']}"]
         for p in profile]))
    shape = decoder_shape(engine_model, dtype)
    limits = measure_limits(dtype)
    roofline = roofline_lines(profile, shape, limits)
    print(f"roofline: read bandwidth {limits.bandwidth_gbs:.1f} GB/s, peak {dtype_name} matmul "
          f"{limits.peak_gflops:.0f} GFLOP/s (measured here); a decode step reads "
          f"{shape.matmul_params * shape.bytes_per_param / 1e6:.0f} MB of weights")
    print(format_table(["batch", "step_ms", "floor_ms", "GB/s", "GFLOP/s", "flop/byte", "bound", "share"],
                       [[r["batch_size"], r["step_ms"], r["floor_ms"], r["achieved_gbs"], r["achieved_gflops"],
                         r["intensity_flops_per_byte"], r["bound"], r["share_of_limit"]] for r in roofline]))
    structured_rows = structured_lines(profile, structured)
    print("structured output (a JSON schema on every sequence) against the same decode steps unconstrained:")
    print(format_table(["batch", "plain_ms", "structured_ms", "mask_ms", "tok/s_ratio"],
                       [[r["batch_size"], r["plain_step_ms"], r["structured_step_ms"], r["mask_ms"],
                         r["tokens_per_s_ratio"]] for r in structured_rows]))

    eos = hf_model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos])
    params = SamplingParams(max_tokens=config.max_tokens)
    max_len = max(len(p) for p in prompts) + config.max_tokens
    runs = []
    for batch_size in config.batch_sizes:
        engine = Engine(
            engine_model,
            EngineConfig.of(kv_cache_bytes=config.kv_cache_bytes, max_num_seqs=batch_size,
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
            "share_of_limit": limits.floor_s(run_cost(shape, engine.num_steps, sum(len(p) for p in prompts),
                                                      engine_tokens)) / engine_s,
        })
        del engine
    primary = next((r for r in runs if r["batch_size"] == config.primary_batch_size), runs[-1])
    result = {
        "benchmark": "engine",
        "model": model_name,
        "dtype": dtype_name,
        "prompts_path": str(config.prompts_path),
        "max_tokens": config.max_tokens,
        **{k: primary[k] for k in ("batch_size", "greedy_match", "num_prompts", "engine_tokens_per_s",
                                   "hf_generate_tokens_per_s", "speedup_vs_hf")},
        "runs": runs,
        "step_profile": profile,
        "roofline": {"bandwidth_gbs": limits.bandwidth_gbs, "peak_gflops": limits.peak_gflops,
                     "peak_dtype": dtype_name, "weight_bytes": shape.matmul_params * shape.bytes_per_param,
                     "runs": roofline},
        "structured_output": structured_rows,
        "environment": environment(),
    }
    headers = ["batch", "prompts", "greedy_match", "mean_out", "max_out", "engine_tok/s", "hf_tok/s", "speedup"]
    rows = [[r["batch_size"], r["num_prompts"], r["greedy_match"], r["mean_output_tokens"], r["max_output_tokens"],
             r["engine_tokens_per_s"], r["hf_generate_tokens_per_s"], r["speedup_vs_hf"]] for r in runs]
    print(format_table(headers, rows))
    if dtype_name != "float32" and primary["greedy_match"] < primary["num_prompts"]:
        print(f"greedy_match < prompts is expected in {dtype_name}: the engine's fused kernels and HF's modules "
              "round differently, so near-ties can flip; run with --dtype float32 for the exact comparison")
    write_json(json_path, result)
    return result
