"""`s3serve bench ...`: the benchmark subcommands (each prints a table and writes JSON)."""

import argparse
from pathlib import Path

from benchmarks.chaos_accounting import FAULTS
from benchmarks.prompt_pool import DEFAULT_PROMPTS
from workers.actors.worker_settings import WorkerSettings
from workers.engine.models import DEFAULT_MODEL
from s3serve_cli.args import add_model_args, given
from s3serve_cli.bench_cluster import add_cluster_parser
from s3serve_cli.bench_coldstart import add_coldstart_parser
from s3serve_cli.bench_latency import add_latency_parser
from s3serve_cli.bench_peers import add_peers_parser
from s3serve_cli.bench_predictor import add_predictor_parser
from s3serve_cli.bench_remaining import add_remaining_parser
from s3serve_cli.bench_simulate import add_simulate_parser
from s3serve_cli.bench_soak import add_soak_parser
from s3serve_cli.config_flags import add_setting_flags


def _bench_engine(args: argparse.Namespace) -> int:
    from benchmarks import engine_bench

    if args.quick:
        config = engine_bench.quick_config(args.prompts)
    else:
        config = engine_bench.full_config(args.prompts)
    overrides = {}
    if args.num_prompts is not None:
        overrides["num_prompts"] = args.num_prompts
    if args.batch_sizes is not None:
        overrides["batch_sizes"] = tuple(args.batch_sizes)
        overrides["primary_batch_size"] = 16 if 16 in args.batch_sizes else args.batch_sizes[-1]
    if args.max_tokens is not None:
        overrides["max_tokens"] = args.max_tokens
    if args.profile_batch_sizes is not None:
        overrides["profile_batch_sizes"] = tuple(args.profile_batch_sizes)
    overrides["dtype"] = args.dtype
    if overrides:
        from dataclasses import replace

        config = replace(config, **overrides)
    engine_bench.run(config, args.model, args.model_cache_dir, args.json)
    return 0


def _bench_policies(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from benchmarks import policy_bench, policy_bench_config

    base = policy_bench_config.quick_config(args.workload) if args.quick else policy_bench_config.PolicyBenchConfig()
    overrides = {
        "trace_path": args.trace,
        "prompts_path": args.prompts,
        "mode": args.mode,
        "time_scale": args.time_scale,
        "predictor": args.predictor,
        "kv_cache_bytes": args.kv_cache_bytes,
        "sweep_sigmas": tuple(args.sweep_sigma or ()),
        "overcommit_step": args.overcommit_step,
    }
    for name in ("preemption_mode", "swap_space_bytes"):
        if getattr(args, name) is not None:
            overrides[name] = getattr(args, name)
    if args.num_requests is not None:
        overrides["num_requests"] = args.num_requests
    if args.max_len is not None:
        overrides["max_len"] = args.max_len
    if args.max_prompt_tokens is not None:
        overrides["max_prompt_tokens"] = args.max_prompt_tokens
    if args.policies is not None:
        overrides["policies"] = tuple(args.policies)
    overrides["prefix_caching"] = not args.no_prefix_caching
    overrides["model_shape"] = args.model_shape
    overrides["device"] = args.device
    if args.tokens_per_hash_id is not None:
        overrides["tokens_per_hash_id"] = args.tokens_per_hash_id
    overrides["workload"] = args.workload
    if args.labels is not None:
        overrides["labels_path"] = args.labels
    # the shipped probe reads SmolLM2-135M's states: the default only for that model
    shipped_fits = args.workload == "natural" and args.model == DEFAULT_MODEL and args.model_shape is None
    probe = args.probe if args.probe is not None else ("default" if shipped_fits else "none")
    overrides["probe"] = None if probe == "none" else probe

    def labeler(records, labels_path, max_len):  # the natural workload's missing true lengths, as `s3serve label`
        from s3serve_cli.label import LabelConfig, label_records

        label_records(records, LabelConfig(prompt_paths=(), out_path=labels_path, max_len=max_len), args.model,
                      args.model_cache_dir)

    policy_bench.run(replace(base, **overrides), args.model, args.model_cache_dir, args.json, args.plot, labeler)
    return 0


def _bench_control_plane(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from benchmarks import control_plane_bench

    config = control_plane_bench.ControlPlaneBenchConfig()
    overrides = {"run_service": not args.no_service,
                 **given((("worker_counts", args.workers), ("num_placements", args.placements),
                          ("concurrency", args.concurrency), ("step_s", args.step_s), ("offered_per_s", args.offered)))}
    if args.quick:
        overrides.setdefault("num_placements", 3000)
    control_plane_bench.run(replace(config, **overrides), args.model, args.model_cache_dir, args.json)
    return 0


def _bench_chaos(args: argparse.Namespace) -> int:
    from benchmarks import chaos_bench

    base = chaos_bench.quick_config() if args.quick else chaos_bench.ChaosBenchConfig()
    overrides = given((("faults", args.faults), ("rate_per_s", args.rate), ("window_s", args.window_s),
                       ("max_tokens", args.max_tokens), ("num_workers", args.workers)))
    from dataclasses import replace

    chaos_bench.run(replace(base, **overrides), args.model, args.model_cache_dir, args.json)
    return 0


def add_bench_parser(commands) -> None:
    """Add `bench` and its benchmarks to the subcommands of the main parser."""
    bench = commands.add_parser(
        "bench", help="run a benchmark; prints a table and writes JSON",
        description="Benchmarks measured side by side in one run (same model, workload and KV budget). Each "
                    "shows a progress bar, prints a table and, with --json, writes the results.")
    benches = bench.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    engine = benches.add_parser(
        "engine",
        help="where an engine step's time goes, and the engine vs Hugging Face generate in static batches",
        description="First a step profile: ms per decode step at each profile batch size, split into model, "
                    "attention, scheduling, input building and sampling, with tokens/s. Then greedy generation "
                    "of the same prompts by the engine and by HF generate in left-padded static batches, same "
                    "model and dtype, same process: token-for-token agreement and tokens/s per batch size.",
    )
    add_model_args(engine)
    engine.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS,
                        help="JSONL prompt file (default: %(default)s)")
    engine.add_argument("--quick", action="store_true",
                        help="32 prompts at batch 16, max 256 new tokens (a few minutes on 2 cores); "
                             "without it: 96 prompts at batch sizes 1, 4, 16, 64")
    engine.add_argument("--num-prompts", type=int, default=None, help="override the number of prompts")
    engine.add_argument("--batch-sizes", type=int, nargs="+", default=None,
                        help="override the batch sizes (engine max running sequences = HF batch size)")
    engine.add_argument("--max-tokens", type=int, default=None, help="override the generation limit per prompt")
    engine.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                        help="model dtype of both sides (default: auto, bfloat16 where the CPU has AVX512-BF16 or "
                             "AMX; on AVX2-only CPUs float32 over bf16 linear weights, both sides; float32 gives "
                             "the exact greedy comparison)")
    engine.add_argument("--profile-batch-sizes", type=int, nargs="+", default=None, metavar="N",
                        help="batch sizes of the step profile (default 1 16 64 128; the full run adds 256)")
    engine.add_argument("--json", type=Path, default=None, help="write the results to this JSON file")
    engine.set_defaults(handler=_bench_engine)

    policies = benches.add_parser(
        "policies",
        help="max_reserve vs paged_greedy vs s3 vs oracle on one model, trace and KV budget",
        description="Replays a serving trace (real prompt text, outputs forced to the trace's lengths) through "
                    "the engine once per scheduling policy, same model and KV budget, and reports throughput, "
                    "concurrency, KV use, preemptions, recomputation, swapping and latency, with s3's ratios.",
    )
    add_model_args(policies)
    policies.add_argument("--trace", type=Path, default=Path("../shared/data/traces/AzureLLMInferenceTrace_conv.csv"),
                          help="Azure CSV or Mooncake JSONL trace (default: %(default)s)")
    policies.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS,
                          help="prompt texts the replayed prompts are cut from (default: %(default)s)")
    policies.add_argument("--num-requests", type=int, default=None, help="first N trace rows (default 64; 32 with --quick)")
    policies.add_argument("--model-shape", default=None, choices=("tiny", "smollm2-135m", "llama-7b", "gptj-6b"),
                          help="run a randomly initialised model of this shape instead of the model's weights "
                               "(outputs are forced, so throughput does not depend on them): llama-7b on a GPU "
                               "shows the paper's regime without downloading weights; the tokenizer stays --model's")
    policies.add_argument("--device", default="cpu", help="where the engines run: cpu (default) or cuda")
    policies.add_argument("--kv-cache-bytes", type=int, default=None,
                          help="KV budget in bytes (default: room for 4 worst-case sequences of --max-len tokens)")
    policies.add_argument("--max-len", type=int, default=None,
                          help="longest sequence; each request's max_tokens is max-len minus its prompt (default 1024; "
                               "512 with --quick --workload natural, where half the answers run to the limit)")
    policies.add_argument("--max-prompt-tokens", type=int, default=None,
                          help="cap on replayed prompt length, reported (default 256; 128 with --quick)")
    policies.add_argument("--mode", choices=("offline", "online"), default="offline",
                          help="offline: every request at t=0; online: the trace's arrival times (default: %(default)s)")
    policies.add_argument("--time-scale", type=float, default=1.0,
                          help="online mode: multiply arrival times by this (<1 compresses) (default: %(default)s)")
    policies.add_argument("--workload", choices=("trace", "natural"), default="trace",
                          help="trace: prompt text cut to the trace's lengths, outputs forced to its lengths; "
                               "natural: held-out pool prompts (never in the shipped predictor's training labels; "
                               "the split is in the JSON) answered greedily to the model's own stop, the same "
                               "tokens under every policy (checked), arrivals from --trace (default: %(default)s)")
    policies.add_argument("--labels", type=Path, default=None, metavar="FILE",
                          help="natural workload: true lengths for the oracle, labelled first where missing "
                               "(default: benchmarks/labels/smollm2-135m-instruct.heldout.greedy.jsonl)")
    policies.add_argument("--probe", default=None, metavar="DIR",
                          help="natural workload: also run s3 and s3_peak with the hidden-state probe refining "
                               "their bounds inside the engine (after prefill, then every 64 decoded tokens), as "
                               "s3+probe and s3_peak+probe: 'default' (the shipped SmolLM2 probe; the default with "
                               "--workload natural and the default model), a folder from `s3serve probe train`, "
                               "or 'none'")
    policies.add_argument("--predictor", default="noisy-oracle:0.3",
                          help="noisy-oracle:SIGMA (true length x seeded log-normal error; a benchmark instrument), "
                               "default (the predictor the service ships and uses by default) or a trained "
                               "predictor artifact directory from train-predictor (default: %(default)s)")
    policies.add_argument("--policies", nargs="+", default=None, metavar="POLICY",
                          help="subset of max_reserve paged_greedy s3 s3_peak sglang_ratio oracle (default: all six)")
    policies.add_argument("--sweep-sigma", type=float, nargs="+", default=None, metavar="SIGMA",
                          help="also run s3 and s3_peak with noisy-oracle predictors of these sigmas; reports tok/s and preemptions")
    add_setting_flags(policies.add_argument_group("every policy's engines"), WorkerSettings,
                      ("overcommit_step", "preemption_mode", "swap_space_bytes"))
    policies.add_argument("--no-prefix-caching", action="store_true",
                          help="run every engine with its prefix cache off (on by default, as in the service)")
    policies.add_argument("--tokens-per-hash-id", type=int, default=None, metavar="N",
                          help="traces with Mooncake hash_ids: each id becomes N tokens of shared text (default 16; "
                               "the trace's ids stand for 512) and whole sessions are replayed; paged_greedy, s3 "
                               "and s3_peak then also run with the prefix cache off")
    policies.add_argument("--quick", action="store_true", help="32 requests, prompts capped at 128 tokens (< 15 min here)")
    policies.add_argument("--json", type=Path, default=None, help="write the results to this JSON file")
    policies.add_argument("--plot", type=Path, default=None, metavar="DIR",
                          help="write throughput.png, kv_utilisation.png and concurrency.png here")
    policies.set_defaults(handler=_bench_policies)

    add_cluster_parser(benches)

    add_peers_parser(benches)

    add_latency_parser(benches)

    control = benches.add_parser(
        "control-plane",
        help="controller placements/s and place latency at 16, 256, 1,024 simulated workers; the service's overhead",
        description="Placement: the controller's logic (ControlPlane, as the actor runs it) over the real embedded "
                    "Redis and many simulated workers (no model; each holds a request's blocks for a configurable "
                    "step time per output token), while releases and the controller's own polling loop run: "
                    "capacity (placements/s from concurrent simulated routers placing back to back) and place "
                    "latency p50/p99 under Poisson arrivals (--offered, at most 90% of the capacity) per pool "
                    "size. Overhead: the real service (one SmolLM2 worker) answering 40 sequential requests and "
                    "5 bursts of 32, from its x-s3-overhead-ms header (router + predictor + placement).",
    )
    add_model_args(control)
    control.add_argument("--workers", type=int, nargs="+", default=None, metavar="N",
                         help="simulated pool sizes (default 16 256 1024)")
    control.add_argument("--placements", type=int, default=None, help="placements per pool size (default 5000)")
    control.add_argument("--concurrency", type=int, default=None,
                         help="simulated routers placing back to back in the capacity run (default 8)")
    control.add_argument("--offered", type=float, default=None, metavar="PER_S",
                         help="arrival rate of the latency run (default 2000 placements/s; capped at 90%% of "
                              "the capacity measured just before)")
    control.add_argument("--step-s", type=float, default=None,
                         help="simulated seconds per generated token (default 0.001)")
    control.add_argument("--no-service", action="store_true", help="skip the real service's overhead")
    control.add_argument("--quick", action="store_true", help="3000 placements per pool size")
    control.add_argument("--json", type=Path, default=None, help="write the results to this JSON file")
    control.set_defaults(handler=_bench_control_plane)

    add_predictor_parser(benches)

    chaos = benches.add_parser(
        "chaos",
        help="faults under load: kill or stop a worker, Redis, the controller; kill a router; fill Redis's disk; "
             "a 10x burst; what was lost",
        description="Starts the real service (two SmolLM2 workers, the embedded Redis under its supervisor) and, "
                    "from a separate process, sends streamed chats at a fixed rate (greedy, ignore_eos, fixed "
                    "max_tokens) while one fault per window is injected: kill -9 of a worker, of the embedded "
                    "redis-server and of the controller; SIGSTOP for 10 s of a worker, of redis-server and of the "
                    "controller; kill -9 of a router replica; the disk under redis-server's append-only file full for "
                    "10 s (a 64 MiB tmpfs mounted for the run: needs root, else left out with the reason); and a "
                    "burst of 10x the concurrency limit. Each prompt "
                    "is first answered alone without faults: every answer must repeat that text. Per fault: "
                    "requests sent in its window, completed whole, refused with Retry-After, failed by status, "
                    "duplicated, truncated, corrupted (whole but another text), lost; seconds until /health is 200 "
                    "and a probe completes; the service's resident memory before and after.",
    )
    add_model_args(chaos)
    chaos.add_argument("--faults", nargs="+", default=None, metavar="FAULT", choices=FAULTS,
                       help=f"which faults, in order (default: all {len(FAULTS)}: {' '.join(FAULTS)})")
    chaos.add_argument("--rate", type=float, default=None, metavar="PER_S",
                       help="chats per second of the steady load (default 2; 1 with --quick)")
    chaos.add_argument("--window-s", type=float, default=None, help="seconds between faults (default 40; 25 with --quick)")
    chaos.add_argument("--max-tokens", type=int, default=None, help="tokens per answer (default 48; 24 with --quick)")
    chaos.add_argument("--workers", type=int, default=None, help="worker actors (default 2)")
    chaos.add_argument("--quick", action="store_true", help="a lighter load and shorter windows (about 5 minutes)")
    chaos.add_argument("--json", type=Path, default=None, help="write the results to this JSON file")
    chaos.set_defaults(handler=_bench_chaos)

    add_simulate_parser(benches)
    add_remaining_parser(benches)
    add_coldstart_parser(benches)
    add_soak_parser(benches)
