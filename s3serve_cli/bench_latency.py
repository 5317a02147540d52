"""`s3serve bench latency`: its arguments (kept apart from `s3serve_cli.bench`, which holds most others)."""

import argparse
from dataclasses import replace
from pathlib import Path

from s3serve_cli.args import add_model_args, given
from s3serve_cli.config_flags import add_setting_flags, given_values
from workers.actors.worker_settings import WorkerSettings

ENGINE_SETTINGS = ("max_num_seqs", "max_num_batched_tokens", "max_queue_wait_s", "preemption_mode",
                   "swap_space_bytes")


def _bench_latency(args: argparse.Namespace) -> int:
    from benchmarks import latency_bench

    config = latency_bench.quick_config() if args.quick else latency_bench.LatencyBenchConfig()
    overrides = given((("num_requests", args.num_requests), ("max_len", args.max_len), ("loads", args.loads),
                       ("settings", args.settings), ("policies", args.policies), ("rounds", args.rounds),
                       ("kv_bound_slots", args.kv_bound_slots), ("predictor", args.predictor),
                       ("probe", args.probe), ("other_probe", args.other_probe), ("seed", args.seed),
                       ("labels_path", args.labels), ("clock", args.clock)))
    if args.bursty_load is not None:
        overrides["bursty_load"] = None if args.bursty_load == 0 else args.bursty_load
    overrides.update(given_values(args, ENGINE_SETTINGS))

    def labeler(records, labels_path, max_len):  # the held-out prompts' missing true lengths, as `s3serve label`
        from s3serve_cli.label import LabelConfig, label_records

        label_records(records, LabelConfig(prompt_paths=(), out_path=labels_path, max_len=max_len), args.model,
                      args.model_cache_dir)

    latency_bench.run(replace(config, **overrides), args.model, args.model_cache_dir, args.json, labeler)
    return 0


def add_latency_parser(benches) -> None:
    latency = benches.add_parser(
        "latency",
        help="FCFS paging vs the service default vs the oracle where requests wait: Poisson and bursty arrivals at "
             "fractions of our own measured capacity, latency, first token, waiting, tokens/s, by length class",
        description="Measures our capacity first (FCFS paging, every request at t=0, requests/s until 90% are "
                    "done), then offers held-out pool prompts (answers forced to the model's own greedy lengths, "
                    "the same work for every policy) at fractions of it: seeded Poisson arrivals, and the Azure "
                    "conv trace's bursty arrivals scaled to a mean rate. In a KV-bound setting (KV for a few "
                    "worst-case sequences, the S3 regime) and the service's default one (the slots bind). "
                    "Policies: fcfs (paged_greedy, vLLM's behaviour), default (s3_peak with the shipped predictor "
                    "and probe, as the service runs), oracle (s3_peak on the true lengths: the ceiling), and on "
                    "request before (the default's order and preemption as before 2026-11-29: by work only while "
                    "KV was scarce, none for shorter work, KV victims passed; with today's aging and starvation "
                    "bound), no_preempt, and victims_passed (the default with preempted_first off: a sequence "
                    "preempted for KV waits in the policy's order, as before 2026-12-02). Rounds interleave every "
                    "setting, point and policy (a point's policies backwards on every second round, so that over "
                    "each pair of rounds a steadily drifting machine favours no row: use an even --rounds); tables "
                    "give medians with their spread, ratios against fcfs per round, the share of the oracle's gain "
                    "the default reaches, and step_ms, the machine's speed in each run (the median step of 4-12 "
                    "sequences: far from paging's where few waited, the machine moved or the policy spends its own "
                    "time per step, not its order).")
    add_model_args(latency)
    latency.add_argument("--num-requests", type=int, default=None, help="requests per point (default 300; 64 with "
                                                                       "--quick)")
    latency.add_argument("--max-len", type=int, default=None, help="longest sequence (default 512)")
    latency.add_argument("--loads", type=float, nargs="+", default=None, metavar="FRACTION",
                         help="Poisson points as fractions of our capacity (default 0.8 0.95 1.2; 0.95 1.2 with "
                              "--quick)")
    latency.add_argument("--bursty-load", type=float, default=None, metavar="FRACTION",
                         help="the bursty point's mean rate as a fraction of capacity (default 0.95; none with "
                              "--quick; 0 leaves it out)")
    latency.add_argument("--settings", nargs="+", default=None, choices=("kv_bound", "default"),
                         help="kv_bound (KV for --kv-bound-slots worst-case sequences) and/or default (KV for "
                              "max_num_seqs sequences of max_len: the slots bind) (default both; kv_bound with "
                              "--quick)")
    latency.add_argument("--policies", nargs="+", default=None, metavar="POLICY",
                         choices=("fcfs", "default", "oracle", "before", "no_preempt", "other_probe",
                                  "victims_passed"),
                         help="rows: fcfs default oracle (the default) before no_preempt other_probe (the default "
                              "with --other-probe) victims_passed (the default with preempted_first off); fcfs is "
                              "required")
    latency.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 2)")
    latency.add_argument("--kv-bound-slots", type=int, default=None, metavar="N",
                         help="kv_bound: KV for N sequences of max_len tokens (default 8)")
    latency.add_argument("--predictor", default=None,
                         help="what the default predicts with: default (the shipped predictor), noisy-oracle:SIGMA "
                              "or an artifact directory")
    latency.add_argument("--probe", default=None, metavar="DIR",
                         help="the default's hidden-state probe: default (the shipped SmolLM2 one) or a folder "
                              "from `s3serve probe train`")
    latency.add_argument("--other-probe", default=None, metavar="DIR",
                         help="the probe of the other_probe row (a folder from `s3serve probe train`): two probes "
                              "under the default policy in one invocation")
    latency.add_argument("--seed", type=int, default=None,
                         help="which held-out prompts and the Poisson arrivals (default 0; tune on another)")
    latency.add_argument("--labels", type=Path, default=None, metavar="FILE",
                         help="the model's greedy lengths, labelled first where missing (default: "
                              "benchmarks/labels/smollm2-135m-instruct.heldout.greedy.jsonl)")
    latency.add_argument("--clock", default=None, choices=("wall", "modelled"),
                         help="wall: latencies in the machine's seconds (the default); modelled: the engine runs "
                              "every token as ever, but time moves by a step-time model fitted on each setting's "
                              "capacity run (which then runs twice), so the machine's drift between runs cannot "
                              "favour a row; a policy's own host time per step is then counted nowhere")
    add_setting_flags(latency.add_argument_group("every policy's engines"), WorkerSettings, ENGINE_SETTINGS)
    latency.add_argument("--quick", action="store_true",
                         help="64 requests, kv_bound only, loads 0.95 and 1.2, two rounds (under 20 minutes here)")
    latency.add_argument("--json", type=Path, default=None, help="write the results to this JSON file")
    latency.set_defaults(handler=_bench_latency)
