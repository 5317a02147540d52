"""The requests `bench cluster` sends (a trace replay with forced lengths, or the natural workload), and
the predictor artifact the services serve for them.

A trace replay decodes each replayed prompt's tokens to text (the router counts them again)
and forces the trace's output length; the natural workload sends held-out pool prompts as
their chat messages and lets the model stop on its own (`benchmarks.natural_workload`).
Either way `max_tokens` is what the context leaves, as a real client would send.
"""

from dataclasses import replace
from pathlib import Path

from benchmarks.cluster_bench_config import ClusterBenchConfig
from benchmarks.http_load import LoadRequest
from benchmarks.natural_workload import natural_load_requests
from benchmarks.traces import ReplayRequest, build_requests, load_prompt_texts, read_trace, select_sessions

BATCH_PRIORITY = 5  # the class of the requests not sent as urgent (priority 0) when urgent_share > 0


def priority_of(index: int, urgent_share: float) -> int:
    """0 (urgent) for an evenly spread `urgent_share` of request indices, else BATCH_PRIORITY; 0 for all at share 0."""
    if urgent_share <= 0.0:
        return 0
    return 0 if int((index + 1) * urgent_share) > int(index * urgent_share) else BATCH_PRIORITY


def build_load_requests(requests: list[ReplayRequest], tokenizer, max_len: int,
                        urgent_share: float = 0.0) -> tuple[list[LoadRequest], int]:
    """Prompt text and limits per replayed request, and how many prompts changed length through text.

    The router tokenizes the text it receives; decoding a cut of tokens and encoding
    it again can merge or split a few, so the sent prompt's length is counted again
    and the output length clipped to what the context leaves.
    """
    out = []
    num_retokenized = 0
    for index, request in enumerate(requests):
        text = tokenizer.decode(list(request.prompt_token_ids))
        num_prompt = len(tokenizer.encode(text, add_special_tokens=False))
        if not text or num_prompt < 1 or num_prompt >= max_len:
            raise ValueError(f"{request.request_id}: its prompt does not survive decoding ({num_prompt} tokens)")
        num_retokenized += num_prompt != len(request.prompt_token_ids)
        max_tokens = max_len - num_prompt
        out.append(LoadRequest(request.request_id, request.arrival_s, text, num_prompt, max_tokens,
                               min(request.output_tokens, max_tokens), priority_of(index, urgent_share)))
    return out, num_retokenized


def load_plan(config: ClusterBenchConfig, tokenizer, mode: str) -> tuple[list[LoadRequest], bool, dict]:
    """(requests in arrival order, whether they share prefixes (Mooncake sessions), what to report of them)."""
    if config.is_natural:
        plan, split = natural_load_requests(tokenizer, config.num_requests, config.max_len, config.max_prompt_tokens,
                                            mode, config.time_scale, config.trace_path, config.prompts_path)
        plan = [replace(r, priority=priority_of(i, config.urgent_share)) for i, r in enumerate(plan)]
        workload = {"split": split.as_json(), "mean_prompt_tokens": sum(r.num_prompt_tokens for r in plan) / len(plan)}
        print(f"natural workload: {len(plan)} held-out prompts of {config.prompts_path} (mean "
              f"{workload['mean_prompt_tokens']:.0f} tokens), greedy to the model's own stop ({mode}, time scale "
              f"{config.time_scale})")
        return plan, False, workload
    rows = read_trace(config.trace_path, config.num_requests)
    shares_prefixes = any(row.hash_ids for row in rows)
    if shares_prefixes:  # whole sessions, as bench policies replays them
        rows = select_sessions(read_trace(config.trace_path), config.num_requests)
    requests, capping = build_requests(
        rows, tokenizer, load_prompt_texts(config.prompts_path), max_len=config.max_len,
        max_prompt_tokens=config.max_prompt_tokens, mode=mode, time_scale=config.time_scale or 1.0,
        tokens_per_hash_id=config.tokens_per_hash_id if shares_prefixes else None)
    plan, num_retokenized = build_load_requests(requests, tokenizer, config.max_len, config.urgent_share)
    print(f"trace {config.trace_path}: {capping.describe()}; {num_retokenized} prompts changed length "
          f"through text ({mode}, time scale {config.time_scale})")
    workload = {"description": capping.describe(), "num_prompt_capped": capping.num_prompt_capped,
                "num_output_capped": capping.num_output_capped, "mean_prompt_tokens": capping.mean_prompt_tokens,
                "mean_output_tokens": capping.mean_output_tokens, "num_prompts_retokenized": num_retokenized}
    return plan, shares_prefixes, workload


def predictor_artifact(config: ClusterBenchConfig, plan: list[LoadRequest], work_dir: Path) -> str | None:
    """The artifact the services serve: a lookup table of noisy-oracle predictions, the default (None), or a dir."""
    if config.predictor == "default":
        return None
    if not config.predictor.startswith("noisy-oracle:"):
        return config.predictor
    from benchmarks.noisy_oracle import NoisyOraclePredictor
    from predictor_service.artifacts import save_predictor
    from predictor_service.length_predictor import LengthQuery
    from predictor_service.table_predictor import TableLengthPredictor

    sigma = float(config.predictor.split(":", 1)[1])
    oracle = NoisyOraclePredictor({r.request_id: r.forced_output_tokens for r in plan}, sigma, config.quantile,
                                  config.max_len)
    predictions = oracle.predict([LengthQuery(r.request_id, (), r.max_tokens) for r in plan])
    table = TableLengthPredictor.from_predictions([r.prompt for r in plan], predictions)
    root = work_dir / "predictor"
    save_predictor(table, root, metrics={}, calibration={"quantile": config.quantile, "source": config.predictor})
    return str(root)
