"""`s3serve bench simulate`: its arguments (kept apart from `s3serve_cli.bench`, which holds the others)."""

import argparse
from dataclasses import replace
from pathlib import Path

from benchmarks.prompt_pool import DEFAULT_PROMPTS
from benchmarks.step_time import GPU_KINDS
from cluster.control.placement import DEFAULT_LATE_BINDING
from cluster.control.routing import DEFAULT_ROUTING, ROUTINGS
from s3serve_cli.args import add_model_args, add_rebalance_arg, given
from s3serve_cli.config_flags import add_setting_flags
from workers.actors.worker_settings import WorkerSettings
from workers.engine.model_shapes import MODEL_SHAPES
from workers.scheduling.policies import POLICY_NAMES


def _bench_simulate(args: argparse.Namespace) -> int:
    from benchmarks import simulate_bench

    base = simulate_bench.default_config(args.workload, args.quick)
    overrides = {"trace_path": args.trace, "answers_path": args.answers, "prompts_path": args.prompts,
                 "kind": args.kind, "model_shape": args.model_shape, "calibrate": not args.no_calibration,
                 "calibration_device": args.calibration_device}
    overrides |= given((name, getattr(args, name)) for name in (
        "worker_counts", "requests_per_worker", "max_len", "max_prompt_tokens", "sigma", "policies",
        "calibration_requests", "rebalance_min_gap", "overcommit_step", "routings", "bindings",
        "arrival_rate_per_worker"))
    simulate_bench.run(replace(base, **overrides), args.model, args.model_cache_dir, args.json, args.plot)
    return 0


def add_simulate_parser(benches) -> None:
    simulate = benches.add_parser(
        "simulate",
        help="SIMULATION: every policy at 8 to 1,024 workers (the service's scheduler and placement, modelled time)",
        description="A discrete-event simulation, not a measurement. Each worker is the engine's own scheduler, "
                    "block allocator and policy; the controller places with the service's placement functions and "
                    "moves preempted overruns as the service does; only time is modelled: a step takes what a "
                    "roofline says for the model shape on the GPU kind (datasheet bandwidth and FLOPs with assumed "
                    "efficiencies). First, unless --no-calibration, the real engine runs a small workload on this "
                    "CPU and the simulator, calibrated on one policy's steps, is compared with it on the others: "
                    "that error is printed. By default every request arrives at t=0 (capacity, not latency under a "
                    "given load): tok/s is over the whole run, steady_tok/s until 90% of the requests have finished "
                    "(without the drain, when the longest answers decode nearly alone whatever the policy); with "
                    "--arrival-rate they arrive online, and --routing compares how the controller spreads them.",
    )
    add_model_args(simulate)
    simulate.add_argument("--workload", choices=("trace", "paper"), default="trace",
                          help="trace: replay --trace's lengths (long Azure prompts); paper: the S3 paper's kind of "
                               "workload, short instructions with text-davinci-003's answers (--answers), where "
                               "reserving the worst case wastes the most (default: %(default)s)")
    simulate.add_argument("--trace", type=Path, default=Path("../shared/data/traces/AzureLLMInferenceTrace_conv.csv"),
                          help="Azure CSV trace to replay with --workload trace (default: %(default)s)")
    simulate.add_argument("--answers", type=Path,
                          default=Path("../shared/data/prompts/text-davinci-003_predictions.jsonl"),
                          help="JSONL of instruction, input, response for --workload paper, measured in the model's "
                               "tokens (default: %(default)s)")
    simulate.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS,
                          help="prompt texts the calibration's replayed prompts are cut from (default: %(default)s)")
    simulate.add_argument("--kind", default="a100-80gb", choices=(*GPU_KINDS, "cpu"),
                          help="GPU kind of every worker, or cpu: the step model calibrated on this machine "
                               "(default: %(default)s)")
    simulate.add_argument("--model-shape", default="llama-7b", choices=tuple(MODEL_SHAPES),
                          help="model shape the roofline prices, bf16 (default: %(default)s)")
    simulate.add_argument("--workers", dest="worker_counts", type=int, nargs="+", default=None, metavar="N",
                          help="cluster sizes (default 8 64 256 1024, 8 64 with --quick; paper: 8 64, 8 with --quick)")
    simulate.add_argument("--requests-per-worker", type=int, default=None,
                          help="trace rows per worker, reused in a fresh seeded order when the trace runs out "
                               "(default 200, 150 with --quick; paper: 1000, 600 with --quick)")
    simulate.add_argument("--max-len", type=int, default=None, help="longest sequence in tokens (default 2048)")
    simulate.add_argument("--max-prompt-tokens", type=int, default=None, help="prompts are capped to this (default 1024)")
    simulate.add_argument("--sigma", type=float, default=None,
                          help="log-normal error of the noisy-oracle predictor (default 0.3)")
    simulate.add_argument("--policies", nargs="+", default=None, metavar="POLICY",
                          choices=POLICY_NAMES,
                          help="policies to simulate (default: max_reserve paged_greedy s3 s3_peak sglang_ratio)")
    simulate.add_argument("--calibration-requests", type=int, default=None, metavar="N",
                          help="trace rows the real engine runs per policy in the calibration (default 24; 16 with "
                               "--quick)")
    simulate.add_argument("--calibration-device", default="cpu", metavar="DEVICE",
                          help="where the calibration's real engine runs: cpu (SmolLM2-135M's weights) or cuda (a "
                               "random bf16 model of --model-shape; its measured steps also check --kind's roofline, "
                               "so name the GPU it runs on) (default: %(default)s)")
    simulate.add_argument("--no-calibration", action="store_true",
                          help="skip the real-engine comparison on this CPU (not allowed with --kind cpu)")
    simulate.add_argument("--routing", dest="routings", nargs="+", default=None, choices=ROUTINGS,
                          metavar="ROUTING",
                          help="the controller's routing, several to compare each with every policy: predicted_work "
                               "(where a request is predicted to finish soonest), room (most free KV) or "
                               f"least_requests (default: {DEFAULT_ROUTING})")
    simulate.add_argument("--binding", dest="bindings", nargs="+", default=None, choices=("late", "arrival"),
                          metavar="BINDING",
                          help="when a request is bound to a worker, several to compare: late (the service's "
                               "late_binding: it waits in the controller's queue until a worker can start it) or "
                               "arrival (to a worker with KV room as it arrives) (default: the service's, "
                               f"{'late' if DEFAULT_LATE_BINDING else 'arrival'})")
    simulate.add_argument("--arrival-rate", dest="arrival_rate_per_worker", type=float, default=None, metavar="R",
                          help="requests arrive online, R per second per worker (Poisson, seeded) instead of all at "
                               "t=0: latency under load rather than capacity")
    add_rebalance_arg(simulate, "the controller's")
    add_setting_flags(simulate, WorkerSettings, ("overcommit_step",))
    simulate.add_argument("--quick", action="store_true", help="fewer workers and requests (a few minutes)")
    simulate.add_argument("--json", type=Path, default=None, help="write the results to this JSON file")
    simulate.add_argument("--plot", type=Path, default=None, metavar="PNG",
                          help="tokens/s per worker and p99 latency against cluster size")
    simulate.set_defaults(handler=_bench_simulate)
