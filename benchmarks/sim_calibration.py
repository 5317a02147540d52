"""The simulator checked against the real engine on this machine.

The real engine (SmolLM2-135M on the CPU, or a random model of a shape on a GPU; prefix cache
off, outputs forced to the trace's lengths, all requests queued at t=0) runs one policy; its
measured steps (`Engine.last_shape` and wall seconds) calibrate a `LinearStepModel`. Then the
same requests run through the real engine and through the simulator (one worker, same KV
blocks, same limits, same bounds) under other policies: the difference in tokens/s is the
simulator's error on a workload it was not fitted to. On a GPU, the roofline the cluster
simulation prices steps with is checked against the same measured steps and runs.
"""

import time
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from benchmarks.noisy_oracle import NoisyOraclePredictor
from benchmarks.sim_worker import SimConfig, SimRequest, simulate_worker
from benchmarks.step_time import (CalibrationError, LinearStepModel, RooflineStepModel, StepModel, calibration_error,
                                  fit_linear, gpu_kind, shape_cost)
from predictor_service.length_predictor import LengthQuery
from workers.engine.engine import Engine
from workers.scheduling.engine_config import EngineConfig
from workers.scheduling.policies import make_policy
from workers.values.sampling_params import SamplingParams
from workers.values.step_output import StepShape


@dataclass(frozen=True, slots=True)
class EngineRun:
    policy: str
    tokens_per_s: float
    wall_s: float
    samples: list[tuple[StepShape, float]] = field(default_factory=list)


def run_engine(model, requests: list[SimRequest], prompts: dict[str, list[int]], policy: str, max_len: int,
               kv_cache_bytes: int, max_num_seqs: int, max_num_batched_tokens: int, progress=None) -> EngineRun:
    """Every request at t=0 through a fresh engine; tokens/s and each step's (shape, seconds)."""
    engine = Engine(model, EngineConfig.of(kv_cache_bytes=kv_cache_bytes, max_num_seqs=max_num_seqs,
                                        max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_len,
                                        prefix_caching=False),
                    policy=make_policy(policy, max_model_len=max_len))
    start_s = time.monotonic()
    for request in requests:
        engine.add_request(prompts[request.request_id],
                           SamplingParams(max_tokens=request.max_tokens, ignore_eos=True,
                                          forced_output_tokens=request.num_output_tokens),
                           seq_id=request.request_id, predicted_output_tokens=request.predicted_output_tokens,
                           arrival_s=start_s)
    samples, num_tokens = [], 0
    while engine.has_unfinished():
        step_start_s = time.perf_counter()
        outputs = engine.step()
        duration_s = time.perf_counter() - step_start_s
        if engine.last_num_scheduled:
            samples.append((engine.last_shape, duration_s))
        num_tokens += len(outputs)
        if progress is not None:
            progress.update(sum(1 for out in outputs if out.is_finished))
    wall_s = time.monotonic() - start_s
    return EngineRun(policy, num_tokens / wall_s, wall_s, samples)


def simulate_one_worker(requests: list[SimRequest], policy: str, max_len: int, num_blocks: int, block_size: int,
                        max_num_seqs: int, max_num_batched_tokens: int, step_model) -> float:
    """Tokens/s of the same requests on one simulated worker, queued at t=0 as in `run_engine`."""
    config = SimConfig(num_workers=1, num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
                       max_num_batched_tokens=max_num_batched_tokens)
    return simulate_worker(requests, config, make_policy(policy, max_model_len=max_len), step_model).tokens_per_s


@dataclass(frozen=True, slots=True)
class Calibration:
    """The fitted CPU step model, its fit on the calibration run, and the agreement on other policies.

    Attributes:
        fit: the fitted model's error on the steps it was fitted to.
        agreement: (policy, real tokens/s, simulated tokens/s, error %) for every policy run; the first
            is the policy the model was fitted on, the others test it.
        roofline_fit: the roofline's error on every measured step of every policy (None: not checked).
        roofline_agreement: (policy, real tokens/s, tokens/s simulated with the roofline, error %).
    """

    model: LinearStepModel
    calibrated_on: str
    fit: CalibrationError
    agreement: list[tuple[str, float, float, float]]
    roofline_fit: CalibrationError | None = None
    roofline_agreement: list[tuple[str, float, float, float]] = field(default_factory=list)


def calibrate(model, requests: list[SimRequest], prompts: dict[str, list[int]], policies: tuple[str, ...],
              max_len: int, kv_cache_bytes: int, num_blocks: int, block_size: int, max_num_seqs: int,
              max_num_batched_tokens: int, kv_bytes_per_token: int, progress=None,
              roofline: StepModel | None = None, measured_on: str = "the CPU engine") -> Calibration:
    """Fit on the first policy's real run; compare real and simulated tokens/s for every policy.

    `roofline`, the step model priced from the hardware's datasheet, is checked on the same runs."""
    runs = [run_engine(model, requests, prompts, policy, max_len, kv_cache_bytes, max_num_seqs,
                       max_num_batched_tokens, progress) for policy in policies]
    fitted = fit_linear(runs[0].samples, kv_bytes_per_token, measured_on)

    def agreement_of(step_model: StepModel) -> list[tuple[str, float, float, float]]:
        rows = []
        for run in runs:
            simulated = simulate_one_worker(requests, run.policy, max_len, num_blocks, block_size, max_num_seqs,
                                            max_num_batched_tokens, step_model)
            rows.append((run.policy, run.tokens_per_s, simulated,
                         100.0 * (simulated - run.tokens_per_s) / run.tokens_per_s))
        return rows

    if roofline is None:
        return Calibration(fitted, policies[0], calibration_error(fitted, runs[0].samples), agreement_of(fitted))
    every_step = [sample for run in runs for sample in run.samples]
    return Calibration(fitted, policies[0], calibration_error(fitted, runs[0].samples), agreement_of(fitted),
                       calibration_error(roofline, every_step), agreement_of(roofline))


CALIBRATION_POLICIES = ("paged_greedy", "max_reserve", "s3")  # fitted on the first, tested on the others


def calibration_model(device: str, model_shape: str, model_dir: Path, vocab_size: int, max_len: int):
    """The model the calibration's real engine runs: SmolLM2's weights on the CPU (as served: `as_served`), a random
    bf16 shape on a GPU."""
    import torch

    from workers.engine.linear_weights import as_served
    from workers.engine.model_shapes import make_shaped_model
    from workers.engine.models import load_model

    if device == "cpu":
        return as_served(load_model(model_dir))
    return make_shaped_model(model_shape, vocab_size=vocab_size, dtype=torch.bfloat16, device=device,
                             max_position_embeddings=max(max_len, 512))


def calibrate_on_trace(rows, model_name: str, model_cache_dir: Path | None, *, device: str, model_shape: str,
                       kind: str, max_len: int, block_size: int, sigma: float, seed: int,
                       prompts_path: Path) -> Calibration:
    """`calibrate` on trace rows (prompt texts cut from `prompts_path`), every request at t=0, with noisy-oracle
    bounds (`sigma`) and KV for 4 worst-case sequences; on a GPU (`device` not "cpu") the roofline of `kind` and
    `model_shape` is checked too."""
    from benchmarks.traces import build_requests, load_prompt_texts
    from workers.engine.model_runner import pool_shape_for
    from workers.engine.models import load_tokenizer, resolve_model_dir

    model_dir = resolve_model_dir(model_name, model_cache_dir)
    tokenizer = load_tokenizer(model_dir)
    replay, _ = build_requests(rows, tokenizer, load_prompt_texts(prompts_path), max_len=max_len,
                               max_prompt_tokens=128, mode="offline", time_scale=1.0)
    model = calibration_model(device, model_shape, model_dir, len(tokenizer), max_len)
    pool = pool_shape_for(model.config, 1, block_size, model.dtype)
    kv_bytes_per_token = pool.bytes_per_block // pool.block_size
    kv_cache_bytes = 4 * max_len * kv_bytes_per_token  # max_reserve fits 4 sequences, as in bench policies
    num_blocks = kv_cache_bytes // pool.bytes_per_block
    oracle = NoisyOraclePredictor({r.request_id: r.output_tokens for r in replay}, sigma=sigma, max_len=max_len,
                                  seed=seed)
    bounds = oracle.predict([LengthQuery(r.request_id, r.prompt_token_ids, max_len - len(r.prompt_token_ids))
                             for r in replay])
    requests = [SimRequest(r.request_id, 0.0, len(r.prompt_token_ids), r.output_tokens,
                           max_len - len(r.prompt_token_ids), b.upper_bound_tokens) for r, b in zip(replay, bounds)]
    prompts = {r.request_id: list(r.prompt_token_ids) for r in replay}
    on_gpu = device != "cpu"
    roofline = RooflineStepModel(gpu_kind(kind), shape_cost(model_shape)) if on_gpu else None
    measured_on = f"the {device} engine ({model_shape}, bf16)" if on_gpu else "the CPU engine"
    with tqdm(total=len(requests) * len(CALIBRATION_POLICIES), desc="calibration: real engine", unit="req") as progress:
        return calibrate(model, requests, prompts, CALIBRATION_POLICIES, max_len, kv_cache_bytes, num_blocks,
                         block_size, 128, 512, kv_bytes_per_token, progress, roofline, measured_on)
