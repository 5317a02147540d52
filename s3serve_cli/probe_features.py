"""`s3serve probe extract`: the hidden-state probe's training rows, taken from the engine's own forward.

The probe (`predictor_service.hidden_probe`) reads the final-norm hidden state of the
row the engine samples from. Its training rows must be those very vectors, so they
are recorded by running the serving engine itself over labelled prompts with a
`HiddenStateRecorder` as its probe: at the prefill's sample (0 tokens decoded) and
every `interval_tokens` decoded tokens up to `last_checkpoint_tokens`. Greedy decoding
is deterministic, so the first tokens of a labelled greedy answer come out again here;
generation stops after the last checkpoint, and the remaining length at a checkpoint
is the label's length minus the tokens decoded. Every run must end where its label
ends, or at that cap when the label runs past it; `ExtractionReport.num_disagreeing`
counts (and leaves out) the ones that did not: a label made with other settings, or
numerics that moved a greedy tie.
"""

from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
import torch

from predictor_service.hidden_features import HiddenFeatures
from predictor_service.probe_files import DEFAULT_INTERVAL_TOKENS, DEFAULT_LAST_CHECKPOINT_TOKENS
from workers.engine.engine import Engine
from workers.scheduling.engine_config import EngineConfig
from workers.scheduling.length_probe import LengthProbe, ProbeQuery, RemainingEstimate
from workers.values.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class FeatureJob:
    """One labelled prompt to read: its chat-templated tokens and what its label says."""

    prompt_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int  # the label's generation limit
    output_tokens: int  # the label's length


class HiddenStateRecorder(LengthProbe):
    """A probe that predicts nothing and keeps a copy of every row it is shown, up to a decoded count."""

    refines_bounds = False

    def __init__(self, interval_tokens: int, last_checkpoint_tokens: int) -> None:
        if interval_tokens < 1 or last_checkpoint_tokens < 0:
            raise ValueError(f"interval_tokens must be >= 1 and last_checkpoint_tokens >= 0, got "
                             f"{interval_tokens} and {last_checkpoint_tokens}")
        self.interval_tokens = interval_tokens
        self.last_checkpoint_tokens = last_checkpoint_tokens
        self.rows: dict[tuple[str, int], np.ndarray] = {}  # (seq_id, decoded) -> [hidden_size] float16

    def is_due(self, num_output_tokens: int) -> bool:
        return num_output_tokens <= self.last_checkpoint_tokens and super().is_due(num_output_tokens)

    def estimate_remaining(self, hidden, queries: list[ProbeQuery]) -> list[RemainingEstimate | None]:
        values = hidden.to(torch.float16).cpu().numpy()  # [N, hidden_size]
        for row, query in zip(values, queries, strict=True):
            self.rows[(query.seq_id, query.num_output_tokens)] = row
        return [None] * len(queries)


@dataclass(frozen=True, slots=True)
class ExtractionReport:
    num_prompts: int
    num_rows: int
    num_disagreeing: int  # ended at another length than the label's (capped at the last checkpoint + 1)
    disagreeing_prompt_ids: tuple[str, ...]


def extract_hidden_features(
    model: torch.nn.Module,
    jobs: list[FeatureJob],
    max_len: int,
    interval_tokens: int = DEFAULT_INTERVAL_TOKENS,
    last_checkpoint_tokens: int = DEFAULT_LAST_CHECKPOINT_TOKENS,
    max_num_seqs: int = 32,
    kv_cache_bytes: int = 1024**3,
    on_finished: Callable[[], None] | None = None,
) -> tuple[HiddenFeatures, ExtractionReport]:
    """Greedy-run each job's prompt to one token past the last checkpoint (or its stop) and record its rows."""
    recorder = HiddenStateRecorder(interval_tokens, last_checkpoint_tokens)
    engine = Engine(model, EngineConfig.of(kv_cache_bytes=kv_cache_bytes, max_num_seqs=max_num_seqs,
                                        max_num_batched_tokens=max(512, max_num_seqs), max_model_len=max_len),
                    probe=recorder)
    by_seq: dict[str, FeatureJob] = {}
    decoded: dict[str, int] = {}
    next_job = 0
    while next_job < len(jobs) or engine.has_unfinished():
        while next_job < len(jobs) and engine.num_waiting < max_num_seqs:
            job = jobs[next_job]
            cap = min(job.max_tokens, last_checkpoint_tokens + 1)
            seq_id = engine.add_request(list(job.prompt_token_ids), SamplingParams(max_tokens=cap, temperature=0.0),
                                        seq_id=f"{next_job}")
            by_seq[seq_id] = job
            next_job += 1
        for out in engine.step():
            if out.is_finished:
                decoded[out.seq_id] = len(out.output_token_ids)
                if on_finished is not None:
                    on_finished()
    # Greedy is deterministic: the run must end where the label ends, or at the cap if the label runs past it.
    disagreeing = tuple(
        job.prompt_id for seq_id, job in by_seq.items()
        if decoded[seq_id] != min(job.output_tokens, job.max_tokens, last_checkpoint_tokens + 1))
    keys = sorted(k for k in recorder.rows if by_seq[k[0]].prompt_id not in disagreeing
                  and k[1] < by_seq[k[0]].output_tokens)
    rows = [by_seq[seq_id] for seq_id, _ in keys]
    features = HiddenFeatures(
        prompt_ids=np.array([job.prompt_id for job in rows], dtype=str),
        num_prompt_tokens=np.array([len(job.prompt_token_ids) for job in rows], dtype=np.int64),
        num_output_tokens=np.array([decoded_count for _, decoded_count in keys], dtype=np.int64),
        max_tokens=np.array([job.max_tokens for job in rows], dtype=np.int64),
        output_tokens=np.array([job.output_tokens for job in rows], dtype=np.int64),
        hidden=np.stack([recorder.rows[k] for k in keys]) if keys else np.zeros((0, model.config.hidden_size),
                                                                               np.float16),
        meta={"model_dtype": str(model.dtype), "max_len": max_len, "interval_tokens": interval_tokens,
              "last_checkpoint_tokens": last_checkpoint_tokens, "temperature": 0.0},
    )
    report = ExtractionReport(len(jobs), len(keys), len(disagreeing), disagreeing)
    return features, report


def report_dict(report: ExtractionReport) -> dict:
    return asdict(report) | {"disagreeing_prompt_ids": list(report.disagreeing_prompt_ids)}
