"""`s3serve label`: the served model's own output lengths, the predictor's training labels.

Every prompt runs through the engine with the chat template and the service's
default sampling settings; one JSON line per (prompt, sample) records the
prompt id, token counts, finish reason and the settings used. Lines are
appended as requests finish, so an interrupted run resumes where it stopped.
No prompt text is written: label files can be shared without the prompts.
"""

import json
import random
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from benchmarks.prompt_pool import PromptRecord, encode_chat, read_prompts
from cluster.config import service_default
from workers.engine.engine import Engine
from workers.engine.linear_weights import as_served
from workers.engine.models import DEFAULT_MODEL, load_model, load_tokenizer, resolve_model_dir
from workers.scheduling.engine_config import EngineConfig
from workers.values.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class LabelConfig:
    """What `label` runs.

    Attributes:
        prompt_paths: prompt files (any format `read_prompts` understands).
        out_path: labels JSONL, appended to (resumable).
        max_len: longest sequence; max_tokens is max_len minus the prompt.
        temperature, top_p: the service's default sampling settings.
        num_samples: samples per prompt (lengths vary when sampling).
        seed: base seed; each (prompt, sample) derives its own.
        limit: label at most this many prompts; None for all.
        shuffle: take prompts in a seeded random order (a partial run then
            covers every source set of a pool file, not just the first).
        max_num_seqs: engine batch.
        kv_cache_bytes: engine KV budget.
    """

    prompt_paths: tuple[Path, ...]
    out_path: Path
    max_len: int = 1024
    temperature: float = 0.0
    top_p: float = 1.0
    num_samples: int = 1
    seed: int = 0
    limit: int | None = None
    shuffle: bool = False
    max_num_seqs: int = service_default("max_num_seqs")
    kv_cache_bytes: int = 1024**3

    def __post_init__(self) -> None:
        if self.num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {self.num_samples}")
        if self.max_len < 2:
            raise ValueError(f"max_len must be >= 2, got {self.max_len}")
        if self.temperature == 0.0 and self.num_samples > 1:
            raise ValueError("num_samples > 1 needs a temperature > 0: greedy samples are all the same")


def read_done(out_path: Path, model: str | None = None, max_len: int | None = None,
              temperature: float | None = None, top_p: float | None = None,
              base_seed: int | None = None) -> set[tuple[str, int]]:
    """(prompt_id, sample) pairs already in a labels file, counting only rows made with the given model,
    max_len, temperature, top_p and (sampled rows) base seed; those not given match anything. A torn
    last line is ignored."""
    done = set()
    if out_path.is_file():
        for line in out_path.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # an interrupted write; that label is redone
            if ((model is None or row.get("model") == model) and (max_len is None or row.get("max_len") == max_len)
                    and (temperature is None or row.get("sampling", {}).get("temperature") == temperature)
                    and (top_p is None or row.get("sampling", {}).get("top_p", 1.0) == top_p)
                    and (base_seed is None or row.get("sampling", {}).get("seed") in
                         (None, _sample_seed(base_seed, row["prompt_id"], row["sample"])))):
                done.add((row["prompt_id"], row["sample"]))
    return done


def _sample_seed(base_seed: int, prompt_id: str, sample: int) -> int:
    return (base_seed * 1_000_003 + zlib.crc32(f"{prompt_id}#{sample}".encode())) % 2**31


def run_labeling(config: LabelConfig, model_name: str = DEFAULT_MODEL, model_cache_dir: Path | None = None) -> dict:
    """Label every pending (prompt, sample) of the config's prompt files; return counts."""
    records = [r for path in config.prompt_paths for r in read_prompts(path)]
    if config.shuffle:
        random.Random(config.seed).shuffle(records)
    if config.limit is not None:
        records = records[: config.limit]
    return label_records(records, config, model_name, model_cache_dir)


def label_records(records: list[PromptRecord], config: LabelConfig, model_name: str = DEFAULT_MODEL,
                  model_cache_dir: Path | None = None) -> dict:
    """Label every pending (prompt, sample) of `records` (the config's prompt files are not read); return counts."""
    model_dir = resolve_model_dir(model_name, model_cache_dir)
    tokenizer = load_tokenizer(model_dir)
    # Rows of other settings do not count: those prompts are labelled again
    done = read_done(config.out_path, model_name, config.max_len, config.temperature, config.top_p, config.seed)
    jobs, skipped_too_long = [], 0
    for record in records:
        pending = [s for s in range(config.num_samples) if (record.prompt_id, s) not in done]
        if not pending:
            continue
        prompt = encode_chat(tokenizer, record, config.max_len - 1)
        if prompt is None:
            skipped_too_long += 1
            continue
        jobs.extend((record.prompt_id, sample, prompt) for sample in pending)
    summary = {"prompts": len(records), "already_labelled": len(done), "to_label": len(jobs),
               "skipped_too_long": skipped_too_long}
    if not jobs:
        return summary
    engine = Engine(
        as_served(load_model(model_dir)),  # the weights the service serves here: its answers' lengths
        EngineConfig.of(kv_cache_bytes=config.kv_cache_bytes, max_num_seqs=config.max_num_seqs,
                     max_num_batched_tokens=max(512, config.max_num_seqs), max_model_len=config.max_len),
    )
    config.out_path.parent.mkdir(parents=True, exist_ok=True)
    in_flight: dict[str, dict] = {}
    next_job, num_at_limit = 0, 0
    with config.out_path.open("a", encoding="utf-8") as out, tqdm(total=len(jobs), desc="labelling", unit="sample") as bar:
        while next_job < len(jobs) or engine.has_unfinished():
            # Keep the queue short so finished labels hit the file early.
            while next_job < len(jobs) and engine.num_waiting < config.max_num_seqs:
                prompt_id, sample, prompt = jobs[next_job]
                params = SamplingParams(
                    max_tokens=config.max_len - len(prompt), temperature=config.temperature, top_p=config.top_p,
                    seed=_sample_seed(config.seed, prompt_id, sample) if config.temperature > 0 else None,
                )
                seq_id = engine.add_request(prompt, params)
                in_flight[seq_id] = {"prompt_id": prompt_id, "sample": sample, "prompt_tokens": len(prompt),
                                     "sampling": asdict(params)}
                next_job += 1
            for step_out in engine.step():
                if step_out.is_finished:
                    row = in_flight.pop(step_out.seq_id)
                    row.update(output_tokens=len(step_out.output_token_ids), finish_reason=step_out.finish_reason,
                               model=model_name, max_len=config.max_len)
                    row["sampling"]["stop"] = list(row["sampling"]["stop"])
                    out.write(json.dumps(row) + "\n")
                    out.flush()
                    num_at_limit += step_out.finish_reason == "length"
                    bar.update(1)
    summary["labelled"] = len(jobs)
    summary["at_length_limit"] = num_at_limit
    return summary
