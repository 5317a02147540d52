"""`s3serve bench remaining`: how well each estimate ranks the *remaining* output of answers still going.

Shortest-remaining-first needs a ranking of the work left, re-estimated as answers decode.
This runs held-out pool prompts (never in the shipped predictor's training labels;
`benchmarks.natural_workload`) greedily to the model's own stop through one engine, and at
0, 64 and 256 decoded tokens records, for every answer still going, what each estimate says
is left; once all have finished, it scores each estimate by Kendall tau against the true
remaining tokens, per checkpoint and per prompt source:

- `point`: the shipped predictor's point estimate minus what was decoded (at least 1);
- `distribution`: the expected remaining output of a log-normal around that point, cut at
  max_tokens, given that the answer is still going (`workers.scheduling.length_distribution`);
- `distribution+loop`: the same, but max_tokens - decoded once the answer repeats itself
  (`workers.scheduling.repetition`: what s3_peak and the worker's stats use);
- `probe`: the shipped hidden-state probe's point (`--length-probe default`: trained with a
  pairwise ranking loss on the pool's other prompts), read from the engine's own rows at
  each checkpoint, as the worker reads it;
- `probe+loop`: the probe's point, but max_tokens - decoded once the answer repeats itself.

It also reports how many answers were flagged as looping and how many of those did run to
max_tokens (the flag's precision).
"""

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from benchmarks.natural_workload import choose_held_out
from benchmarks.prompt_pool import DEFAULT_PROMPTS
from benchmarks.report import environment, format_table, write_json
from cluster.control.worker_probe import load_length_probe
from predictor_service.artifacts import load_predictor
from predictor_service.length_predictor import LengthQuery
from predictor_service.metrics import kendall_tau
from predictor_service.server import DEFAULT_ARTIFACT_ROOT
from workers.engine.engine import Engine, EngineConfig
from workers.engine.models import DEFAULT_MODEL, load_model, load_tokenizer, resolve_model_dir
from workers.scheduling.length_distribution import LengthDistribution
from workers.scheduling.length_probe import LengthProbe, ProbeQuery
from workers.values.sampling_params import SamplingParams

CHECKPOINTS = (0, 64, 256)
ESTIMATES = ("point", "distribution", "distribution+loop", "probe", "probe+loop")


class _ProbeRecorder(LengthProbe):
    """Reads the shipped probe at the checkpoints and records its points without changing any bound."""

    refines_bounds = False

    def __init__(self, probe) -> None:
        self.probe = probe
        self.points: dict[tuple[int, str], int] = {}  # (decoded, seq_id) -> remaining tokens

    def is_due(self, num_output_tokens: int) -> bool:
        return num_output_tokens in CHECKPOINTS

    def estimate_remaining(self, hidden, queries: list[ProbeQuery]) -> list[None]:
        for query, estimate in zip(queries, self.probe.estimate_remaining(hidden, queries), strict=True):
            self.points[(query.num_output_tokens, query.seq_id)] = estimate.point_tokens
        return [None] * len(queries)


@dataclass(frozen=True, slots=True)
class RemainingBenchConfig:
    """What `bench remaining` runs: `num_prompts` held-out prompts (at most `max_prompt_tokens` each), greedy to
    `max_len`, `batch_size` at a time; `length_sigma` is the distribution's spread (s3_peak's default)."""

    num_prompts: int = 96
    max_len: int = 512
    max_prompt_tokens: int = 128
    batch_size: int = 32
    length_sigma: float = 1.0
    prompts_path: Path = DEFAULT_PROMPTS
    seed: int = 0


def quick_config() -> RemainingBenchConfig:
    return RemainingBenchConfig(num_prompts=48)


def _source(prompt_id: str) -> str:
    return prompt_id.split(":", 1)[1].rsplit("-", 1)[0] if ":" in prompt_id else prompt_id


def run(config: RemainingBenchConfig, model_name: str = DEFAULT_MODEL, model_cache_dir: Path | None = None,
        json_path: Path | None = None) -> dict:
    model_dir = resolve_model_dir(model_name, model_cache_dir)
    tokenizer = load_tokenizer(model_dir)
    prompts, split = choose_held_out(tokenizer, config.num_prompts, config.max_prompt_tokens, config.seed,
                                     config.prompts_path)
    texts = {record.prompt_id: record.text for record, _ in prompts}
    predictor = load_predictor(str(DEFAULT_ARTIFACT_ROOT))
    predictor.text_of = lambda query: texts[query.prompt_id]
    queries = [LengthQuery(record.prompt_id, tuple(ids), config.max_len - len(ids)) for record, ids in prompts]
    points = {q.prompt_id: p.point_tokens for q, p in zip(queries, predictor.predict(queries))}
    lengths = LengthDistribution(default_sigma=config.length_sigma)
    model = load_model(model_dir)
    recorder = _ProbeRecorder(load_length_probe("default", model.config.hidden_size))
    engine = Engine(model, EngineConfig.of(kv_cache_bytes=2 * 1024**3, max_num_seqs=config.batch_size,
                                        max_model_len=config.max_len), probe=recorder)
    seen: dict[int, dict[str, dict[str, float]]] = {c: {} for c in CHECKPOINTS}  # checkpoint -> id -> estimates
    final: dict[str, int] = {}
    looping: set[str] = set()
    looping_at: set[tuple[int, str]] = set()  # (checkpoint, seq_id) flagged as repeating by then
    max_tokens_of = {q.prompt_id: q.max_tokens for q in queries}
    for query in queries:
        engine.add_request(list(query.prompt_token_ids), SamplingParams(max_tokens=query.max_tokens),
                           seq_id=query.prompt_id, predicted_output_tokens=points[query.prompt_id])
        point, max_tokens = points[query.prompt_id], query.max_tokens  # before the first token: the prompt alone
        seen[0][query.prompt_id] = {"point": point, "distribution": lengths.remaining_of(point, 0, max_tokens),
                                    "distribution+loop": lengths.remaining_of(point, 0, max_tokens)}
    with tqdm(total=len(queries), desc="answers", unit="req") as progress:
        while engine.has_unfinished():
            for out in engine.step():
                if out.is_finished:
                    final[out.seq_id] = len(out.output_token_ids)
                    progress.update(1)
            for seq in engine.scheduler.running:
                decoded, max_tokens = seq.num_output_tokens, seq.params.max_tokens
                if seq.is_looping:
                    looping.add(seq.seq_id)
                if decoded in seen and decoded > 0 and seq.seq_id not in seen[decoded] and decoded < max_tokens:
                    point = points[seq.seq_id]
                    if seq.is_looping:
                        looping_at.add((decoded, seq.seq_id))
                    seen[decoded][seq.seq_id] = {
                        "point": max(1, point - decoded),
                        "distribution": lengths.remaining_of(point, decoded, max_tokens),
                        "distribution+loop": lengths.remaining_of(point, decoded, max_tokens, seq.is_looping)}
    for checkpoint, estimates in seen.items():  # the probe read each answer still going at each checkpoint
        for seq_id, row in estimates.items():
            probe_point = recorder.points[(checkpoint, seq_id)]
            row["probe"] = probe_point
            row["probe+loop"] = (max_tokens_of[seq_id] - checkpoint if (checkpoint, seq_id) in looping_at
                                 else probe_point)
    rows, by_source = [], []
    result_taus: dict[str, dict] = {}
    for checkpoint, estimates in seen.items():
        ids = sorted(estimates)
        if len(ids) < 3:
            continue
        truth = [final[i] - checkpoint for i in ids]
        taus = {name: kendall_tau([estimates[i][name] for i in ids], truth) for name in ESTIMATES}
        result_taus[str(checkpoint)] = {"num_answers": len(ids), **taus}
        rows.append([checkpoint, len(ids), *(taus[name] for name in ESTIMATES)])
        groups = defaultdict(list)
        for i in ids:
            groups[_source(i)].append(i)
        for source, members in sorted(groups.items()):
            if len(members) >= 5:
                member_truth = [final[i] - checkpoint for i in members]
                by_source.append([checkpoint, source, len(members),
                                  *(kendall_tau([estimates[i][name] for i in members], member_truth)
                                    for name in ESTIMATES)])
    hit_limit = {i for i, n in final.items() if n >= max_tokens_of[i]}
    precision = len(looping & hit_limit) / len(looping) if looping else None
    recall = len(looping & hit_limit) / len(hit_limit) if hit_limit else None
    print(f"{len(queries)} held-out prompts, greedy to the model's stop at max_len {config.max_len}: "
          f"{len(hit_limit)} ran to max_tokens; {len(looping)} were flagged as repeating themselves, "
          f"{len(looping & hit_limit)} of those ran to max_tokens")
    print(format_table(["decoded", "answers", *ESTIMATES], rows))
    if by_source:
        print("by prompt source (sources with at least 5 answers still going):")
        print(format_table(["decoded", "source", "answers", *ESTIMATES], by_source))
    result = {"benchmark": "remaining", "model": model_name, "num_prompts": len(queries), "max_len": config.max_len,
              "length_sigma": config.length_sigma, "kendall_tau": result_taus,
              "by_source": [dict(zip(["decoded", "source", "answers", *ESTIMATES], row)) for row in by_source],
              "looping": {"flagged": len(looping), "hit_limit": len(hit_limit), "precision": precision,
                          "recall": recall},
              "split": split.as_json(), "environment": environment()}
    write_json(json_path, result)
    return result
