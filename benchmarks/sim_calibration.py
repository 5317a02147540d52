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

from benchmarks.sim_worker import SimConfig, SimRequest, simulate_worker
from benchmarks.step_time import CalibrationError, LinearStepModel, StepModel, calibration_error, fit_linear
from workers.engine import Engine
from workers.engine_config import EngineConfig
from workers.policies import make_policy
from workers.sampling_params import SamplingParams
from workers.step_output import StepShape


@dataclass(frozen=True, slots=True)
class EngineRun:
    policy: str
    tokens_per_s: float
    wall_s: float
    samples: list[tuple[StepShape, float]] = field(default_factory=list)


def run_engine(model, requests: list[SimRequest], prompts: dict[str, list[int]], policy: str, max_len: int,
               kv_cache_bytes: int, max_num_seqs: int, max_num_batched_tokens: int, progress=None) -> EngineRun:
    """Every request at t=0 through a fresh engine; tokens/s and each step's (shape, seconds)."""
    engine = Engine(model, EngineConfig(kv_cache_bytes=kv_cache_bytes, max_num_seqs=max_num_seqs,
                                        max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_len,
                                        enable_prefix_caching=False),
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
