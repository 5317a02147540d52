"""The natural-length workload of `bench policies --workload natural`.

Prompts are real chat prompts from the shared pool that the shipped predictor never
trained on (the split is recorded), each run to the model's *own* stop: greedy, EOS or
max_tokens, nothing forced. The true lengths, which only the oracle may read, come from a
labels file made with the same model and settings (`s3serve label`); prompts the file lacks
are labelled first. Arrival times are the Azure conv trace's (online) or all zero (offline).

Every policy must produce the same tokens for a request; `compare_outputs` checks that
and says which requests differ (greedy decoding is deterministic only as far as the
engine's arithmetic does not depend on what else is in the batch).
"""

import hashlib
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from benchmarks.http_load import LoadRequest
from benchmarks.prompt_pool import DEFAULT_PROMPTS, PromptRecord, encode_chat, read_prompts
from benchmarks.traces import ReplayRequest, read_trace
from predictor_service.server import SHIPPED_LABEL_FILES
from predictor_service.training import read_labels

#: The labels the shipped default predictor was trained on: their prompts are never benchmarked here.
TRAINED_LABELS = SHIPPED_LABEL_FILES
#: True greedy lengths of held-out pool prompts (made by `s3serve label`, appended to by this workload).
HELD_OUT_LABELS = Path(__file__).resolve().parent / "labels" / "smollm2-135m-instruct.heldout.greedy.jsonl"


@dataclass(frozen=True, slots=True)
class HeldOutSplit:
    """Which prompts the workload may use, and which it chose.

    Attributes:
        prompts_path: the pool the prompts come from.
        trained_labels: label files of the predictor under test; their prompt ids are excluded.
        num_pool: usable prompts in the pool.
        num_trained: of those, prompts the predictor trained on.
        chosen_ids: the prompts benchmarked, in submission order.
        seed: the shuffle that chose them.
    """

    prompts_path: Path
    trained_labels: tuple[Path, ...]
    num_pool: int
    num_trained: int
    chosen_ids: tuple[str, ...]
    seed: int

    def as_json(self) -> dict:
        return {"prompts": str(self.prompts_path), "excluded_labels": [str(p) for p in self.trained_labels],
                "num_pool_prompts": self.num_pool, "num_trained_prompts": self.num_trained,
                "num_held_out_prompts": self.num_pool - self.num_trained, "seed": self.seed,
                "chosen_prompt_ids": list(self.chosen_ids)}


def choose_held_out(tokenizer, num_prompts: int, max_prompt_tokens: int, seed: int = 0,
                    prompts_path: Path = DEFAULT_PROMPTS, trained_labels: tuple[Path, ...] = TRAINED_LABELS,
                    ) -> tuple[list[tuple[PromptRecord, list[int]]], HeldOutSplit]:
    """`num_prompts` seeded-random prompts the predictor never saw, with their chat token ids (each at most
    `max_prompt_tokens`). Raises ValueError when the pool has fewer such prompts."""
    records = read_prompts(prompts_path)
    trained = {row.prompt_id for row in read_labels(trained_labels)}
    held_out = [r for r in records if r.prompt_id not in trained]
    random.Random(seed).shuffle(held_out)
    chosen = []
    for record in held_out:
        ids = encode_chat(tokenizer, record, max_prompt_tokens)
        if ids is not None:
            chosen.append((record, ids))
            if len(chosen) == num_prompts:
                break
    if len(chosen) < num_prompts:
        raise ValueError(f"{prompts_path} has only {len(chosen)} held-out prompts of at most {max_prompt_tokens} "
                         f"tokens; asked for {num_prompts}")
    num_trained = sum(r.prompt_id in trained for r in records)
    split = HeldOutSplit(Path(prompts_path), tuple(map(Path, trained_labels)), len(records), num_trained,
                         tuple(r.prompt_id for r, _ in chosen), seed)
    return chosen, split


def true_lengths(labels_path: Path, prompts: list[tuple[PromptRecord, list[int]]], max_len: int,
                 model: str) -> dict[str, int]:
    """Greedy output length per prompt id from a labels file, for rows made by `model` with this prompt
    rendering (token count) and max_len; other rows are ignored."""
    if not labels_path.is_file():
        return {}
    wanted = {record.prompt_id: len(ids) for record, ids in prompts}
    lengths = {}
    with labels_path.open(encoding="utf-8") as lines:
        for line in lines:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a labelling run cut short mid-line; that prompt is labelled again
            if (row.get("prompt_id") in wanted and row.get("model") == model and row.get("max_len") == max_len
                    and row.get("sample") == 0 and row.get("sampling", {}).get("temperature") == 0.0
                    and row.get("prompt_tokens") == wanted[row["prompt_id"]]):
                lengths[row["prompt_id"]] = int(row["output_tokens"])
    return lengths


def arrival_times(num_requests: int, mode: str, time_scale: float, trace_path: Path) -> list[float]:
    """Seconds after the start: the trace's first rows' arrivals times `time_scale` (online), or all 0 (offline)."""
    if mode != "online":
        return [0.0] * num_requests
    rows = read_trace(trace_path, num_requests)
    if len(rows) < num_requests:
        raise ValueError(f"{trace_path} has {len(rows)} rows; the workload needs {num_requests} arrival times")
    return [row.arrival_s * time_scale for row in rows]


def natural_requests(prompts: list[tuple[PromptRecord, list[int]]], lengths: dict[str, int], mode: str,
                     time_scale: float, trace_path: Path) -> list[ReplayRequest]:
    """One request per prompt; arrivals from the trace's first rows (online) or 0 (offline).

    `output_tokens` is the labelled true length: the oracle reads it, and runs are checked against it;
    nothing forces it."""
    arrivals = arrival_times(len(prompts), mode, time_scale, trace_path)
    return [ReplayRequest(record.prompt_id, arrival_s, tuple(ids), lengths[record.prompt_id], len(ids),
                          lengths[record.prompt_id])
            for (record, ids), arrival_s in zip(prompts, arrivals)]


def natural_load_requests(tokenizer, num_requests: int, max_len: int, max_prompt_tokens: int, mode: str,
                          time_scale: float, trace_path: Path, prompts_path: Path = DEFAULT_PROMPTS,
                          seed: int = 0) -> tuple[list[LoadRequest], HeldOutSplit]:
    """The natural workload as HTTP requests (`bench cluster --workload natural`): held-out prompts sent as their
    chat messages, `max_tokens` what the context leaves, nothing forced (the model stops on its own)."""
    prompts, split = choose_held_out(tokenizer, num_requests, max_prompt_tokens, seed, prompts_path)
    arrivals = arrival_times(len(prompts), mode, time_scale, trace_path)
    requests = [LoadRequest(record.prompt_id, arrival_s, record.text, len(ids), max_len - len(ids), None,
                            messages=record.messages)
                for (record, ids), arrival_s in zip(prompts, arrivals)]
    return requests, split


def output_digest(token_ids) -> str:
    """A short fingerprint of one answer's token ids."""
    return hashlib.sha256(",".join(map(str, token_ids)).encode()).hexdigest()[:16]


def compare_outputs(digests_by_policy: dict[str, dict[str, str]]) -> dict:
    """Whether every policy produced the same tokens for every request.

    Args:
        digests_by_policy: policy -> request id -> `output_digest` of its answer.

    Returns {"identical": bool, "reference": first policy, "differing": {policy: [request ids]}}.
    """
    if not digests_by_policy:
        return {"identical": True, "reference": None, "differing": {}}
    reference_name, reference = next(iter(digests_by_policy.items()))
    differing = {}
    for name, digests in digests_by_policy.items():
        ids = sorted(rid for rid in reference.keys() | digests.keys() if reference.get(rid) != digests.get(rid))
        if ids:
            differing[name] = ids
    return {"identical": not differing, "reference": reference_name, "differing": differing}


#: Labels the prompts a labels file lacks: (prompt records, labels file to append to, max_len) -> None.
Labeler = Callable[[list[PromptRecord], Path, int], None]


@dataclass(frozen=True, slots=True)
class NaturalWorkload:
    """The requests, the text a predictor reads for each, and what to report about them."""

    requests: list[ReplayRequest]
    texts: dict[str, str]
    split: HeldOutSplit
    labels_path: Path
    max_len: int

    def describe(self) -> dict:
        lengths = [r.output_tokens for r in self.requests]
        limits = [r.output_tokens >= self.max_tokens_of(r) for r in self.requests]
        return {"labels": str(self.labels_path), "split": self.split.as_json(),
                "mean_prompt_tokens": sum(len(r.prompt_token_ids) for r in self.requests) / len(self.requests),
                "mean_output_tokens": sum(lengths) / len(lengths),
                "hit_length_limit_fraction": sum(limits) / len(limits)}

    def max_tokens_of(self, request: ReplayRequest) -> int:
        return self.max_len - len(request.prompt_token_ids)


def build_natural_workload(tokenizer, model: str, num_requests: int, max_len: int, max_prompt_tokens: int,
                           mode: str, time_scale: float, trace_path: Path, labels_path: Path,
                           prompts_path: Path = DEFAULT_PROMPTS, seed: int = 0,
                           labeler: Labeler | None = None) -> NaturalWorkload:
    """Choose held-out prompts, read (or first make, with `labeler`) `model`'s true lengths, build the requests."""
    prompts, split = choose_held_out(tokenizer, num_requests, max_prompt_tokens, seed, prompts_path)
    lengths = true_lengths(labels_path, prompts, max_len, model)
    missing = [record for record, _ in prompts if record.prompt_id not in lengths]
    if missing:
        if labeler is None:
            raise ValueError(f"{labels_path} lacks {model}'s greedy labels at max_len {max_len} for {len(missing)} of the "
                             f"{len(prompts)} prompts (first: {missing[0].prompt_id}); run s3serve label on them")
        print(f"labelling {len(missing)} prompts the labels file {labels_path} lacks (greedy, max_len {max_len})")
        labeler(missing, labels_path, max_len)
        lengths = true_lengths(labels_path, prompts, max_len, model)
        still = [record.prompt_id for record, _ in prompts if record.prompt_id not in lengths]
        if still:
            raise ValueError(f"labelling left {len(still)} prompts without a label (first: {still[0]})")
    requests = natural_requests(prompts, lengths, mode, time_scale, trace_path)
    texts = {record.prompt_id: record.text for record, _ in prompts}
    return NaturalWorkload(requests, texts, split, Path(labels_path), max_len)
