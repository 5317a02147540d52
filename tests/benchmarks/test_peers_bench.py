"""`s3serve bench peers`: the P8 workload, the missing-peer error, and our side end to end (real SmolLM2).

The peers themselves run only where `make peers` made their environments, which `make test` does not
(several hundred MB and a llama.cpp build): their drivers' command lines and result parsing are tested in
tests/benchmarks/test_cpu_peers.py, the peers by running the benchmark.
"""

import json
import subprocess
import sys

import pytest

from benchmarks.peers_bench import (PeersBenchConfig, build_workload, p8_output_lengths, peer_environment, quick_config,
                                    run, run_plan)
from benchmarks.peers_report import report
from workers.engine.runtime import resolve_dtype


def test_p8_lengths_are_the_ones_peers_md_gives():
    lengths = p8_output_lengths(200, 100.0, 0.6, 512, seed=0)
    assert len(lengths) == 200 and sum(lengths) == 23_657  # "sum 23,657 tokens, mean 118"
    assert max(lengths) <= 512 and min(lengths) >= 1


def test_the_quick_workload_is_the_first_half_of_p8s_requests():
    quick = quick_config()
    lengths = p8_output_lengths(quick.num_requests, quick.median_output_tokens, quick.output_sigma,
                                quick.max_output_tokens, quick.seed)
    assert lengths == p8_output_lengths(200, 100.0, 0.6, 512, seed=0)[:100] and sum(lengths) == 12_376


def test_workload_prompts_are_45_tokens_of_pool_text(smollm2_tokenizer, shared_data):
    config = PeersBenchConfig(prompts_path=shared_data / "prompts" / "pool.jsonl", num_requests=20)
    requests = build_workload(config, smollm2_tokenizer)
    assert [len(r.prompt_token_ids) for r in requests] == [45] * 20
    assert len({r.prompt_token_ids for r in requests}) == 20  # cut at different offsets
    assert [r.output_tokens for r in requests] == p8_output_lengths(20, 100.0, 0.6, 512, seed=0)
    assert all(r.arrival_s == 0.0 for r in requests)


def test_peer_environment_applies_the_peers_md_tuning(tmp_path, monkeypatch):
    venv = tmp_path / "venv"
    (venv / "lib").mkdir(parents=True)
    (venv / "lib" / "libiomp5.so").write_bytes(b"")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    env = peer_environment(venv)
    assert "VLLM_CPU_KVCACHE_SPACE" not in env  # it would override the budget
    assert env["HF_HUB_OFFLINE"] == "1" and env["VLLM_USE_AOT_COMPILE"] == "0"
    assert env["VLLM_CPU_OMP_THREADS_BIND"].startswith("0")
    assert env["LD_PRELOAD"].endswith("libiomp5.so") and env["TMPDIR"].startswith(str(venv.resolve()))


def test_a_missing_peer_environment_is_one_line_naming_make_peers(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "s3serve_cli.main", "bench", "peers", "--quick", "--peer-venv", str(tmp_path / "nope")],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 2
    error_lines = [line for line in result.stderr.splitlines() if "error" in line]
    assert len(error_lines) == 1 and "make peers" in error_lines[0] and "Traceback" not in result.stderr


@pytest.mark.slow
def test_our_side_prints_the_table_and_writes_the_json_keys(tmp_path, model_cache_dir, shared_data):
    out = tmp_path / "peers.json"
    result = subprocess.run(
        [sys.executable, "-m", "s3serve_cli.main", "bench", "peers", "--systems", "ours", "--num-requests", "12",
         "--kv-gib", "0.05", "--prompts", str(shared_data / "prompts" / "pool.jsonl"),
         "--model-cache-dir", str(model_cache_dir), "--json", str(out)],
        capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "paged_greedy" in result.stdout and "s3_peak" in result.stdout and "recomp_tok" in result.stdout
    data = json.loads(out.read_text())
    assert {(r["system"], r["policy"]) for r in data["runs"]} == {("ours", "paged_greedy"), ("ours", "s3_peak")}
    for run in data["runs"]:
        assert run["kv_gib"] == 0.05 and run["tokens_per_s"] > 0 and run["exact_lengths"]
        assert run["dtype"] == str(resolve_dtype("auto", "cpu")).removeprefix("torch.")
        assert run["kv_tokens"] == int(0.05 * 1024**3) // 23_040  # bf16 KV tokens, whatever our dtype
    assert data["ratios"]["ours_vs_vllm"] == {} and data["ratios"]["by_policy"] == {}  # no peer run, no ratio
    assert [(r["system"], r["output_tokens"]) for r in data["single"]] == [("ours", 128)]
    assert data["preemption_mode"] == "recompute"  # as vLLM V1 preempts
    for row in data["runs"] + data["single"]:  # the host's bandwidth just before and after, as the roofline reads it
        assert len(row["host_gbs"]) == 2 and all(0.1 < gbs < 10_000 for gbs in row["host_gbs"])
    assert "host_GB/s" in result.stdout and "GB/s in this invocation" in result.stdout


def _row(system, policy, gib, tokens_per_s, precision="bf16"):
    return {"system": system, "policy": policy, "precision": precision, "kv_gib": gib, "kv_tokens": 100,
            "dtype": "bfloat16", "tokens_per_s": tokens_per_s, "preemptions": 0, "recomputed_tokens": 0,
            "latency_p50_s": 1.0, "latency_p99_s": 2.0, "exact_lengths": True, "host_gbs": [20.0, 18.5]}


def test_each_of_our_policies_is_compared_with_each_peer_on_its_own_run_never_the_better_of_ours(tmp_path):
    runs = [_row("vllm", "vllm", 1.0, 100.0), _row("llamacpp", "slots", 1.0, 50.0),
            _row("llamacpp", "slots", 1.0, 80.0, precision="q4_1"),
            _row("ours", "paged_greedy", 1.0, 130.0), _row("ours", "s3_peak", 1.0, 110.0)]
    result = report(PeersBenchConfig(kv_gibs=(1.0,)), runs, [], 1000, tmp_path, None)
    # the headline is the service's default policy, s3_peak, although paged_greedy ran faster
    assert result["ratios"]["ours_vs_vllm"] == {"1.0": 1.1} and result["ratios"]["ours_vs_vllm_policy"] == "s3_peak"
    assert result["ratios"]["ours_vs_llamacpp"] == {"1.0": 2.2}  # the bf16 row; Q4_1 is a peer of its own
    assert result["ratios"]["ours_vs_llamacpp_q4_1"] == {"1.0": 1.375}
    assert result["ratios"]["by_policy"]["vllm"] == {"paged_greedy": {"1.0": 1.3}, "s3_peak": {"1.0": 1.1}}


def test_single_streams_are_compared_on_tokens_per_second_of_one_request_alone(tmp_path, capsys):
    from benchmarks.peers_bench import _single_row

    ours = _single_row("ours", "bf16", {"output_tokens": 101, "latency_s": 2.1, "ttft_s": 0.1})
    assert ours["tokens_per_s"] == pytest.approx(101 / 2.1) and ours["tpot_ms"] == pytest.approx(20.0)
    assert ours["ttft_ms"] == pytest.approx(100.0)
    peer = _single_row("openvino", "bf16", {"output_tokens": 101, "latency_s": 4.2, "ttft_s": 0.2})
    runs = [_row("openvino", "paged", 0.05, 100.0), _row("ours", "s3_peak", 0.05, 150.0)]
    ours, peer = {**ours, "host_gbs": [21.0, 21.5]}, {**peer, "host_gbs": [12.25, 19.0]}
    result = report(PeersBenchConfig(kv_gibs=(0.05,)), runs, [ours, peer], 1000, tmp_path, None)
    assert result["ratios"]["ours_vs_openvino"] == {"0.05": 1.5, "single": pytest.approx(2.0)}
    assert result["single"] == [ours, peer]
    out = capsys.readouterr().out
    assert "single stream" in out and "12.2/19.0" in out  # the peer's single stream ran on a busier host


def test_every_run_shows_the_hosts_bandwidth_around_it_and_the_invocations_range(tmp_path, capsys):
    runs = [_row("vllm", "vllm", 1.0, 100.0), {**_row("ours", "s3_peak", 1.0, 110.0), "host_gbs": [9.5, 24.25]}]
    result = report(PeersBenchConfig(kv_gibs=(1.0,)), runs, [], 1000, tmp_path, tmp_path / "out.json")
    out = capsys.readouterr().out
    assert "host_GB/s" in out and "20.0/18.5" in out and "9.5/24.2" in out
    assert "9.5-24.2 GB/s in this invocation" in out
    assert json.loads((tmp_path / "out.json").read_text())["runs"][1]["host_gbs"] == [9.5, 24.25]
    assert result["ratios"]["ours_vs_vllm"] == {"1.0": pytest.approx(1.1)}  # the probe informs, it never rescales


def test_the_plan_runs_llamacpp_at_our_precision_and_at_q4_1_and_only_the_chosen_systems():
    plan = run_plan(PeersBenchConfig(kv_gibs=(1.0, 0.05), systems=("ours", "llamacpp")), "bf16")
    assert plan[:4] == [(1.0, "llamacpp", "slots (llama.cpp)", "bf16"), (1.0, "llamacpp", "slots (llama.cpp)", "q4_1"),
                        (1.0, "ours", "paged_greedy", "bf16"), (1.0, "ours", "s3_peak", "bf16")]
    assert len(plan) == 8 and {system for _, system, _, _ in plan} == {"ours", "llamacpp"}
    # without bf16 instructions ours, vLLM and OpenVINO compute in fp32: OpenVINO over its export's fp16 weights, ours
    # over bf16 ones (dtype auto) or fp32 ones, vLLM over fp32 ones; llama.cpp keeps its bf16 weights
    for ours in ("fp32+bf16w", "fp32"):
        fp32 = run_plan(PeersBenchConfig(kv_gibs=(1.0,), policies=("s3_peak",)), ours)
        assert [(system, precision) for _, system, _, precision in fp32] == [
            ("vllm", "fp32"), ("llamacpp", "bf16"), ("llamacpp", "q4_1"), ("openvino", "fp32+f16w"), ("ours", ours)]
    quick = run_plan(quick_config(systems=("llamacpp",)), "bf16")
    assert [(gib, precision) for gib, _, _, precision in quick] == [(1.0, "bf16"), (1.0, "q4_1"), (0.05, "bf16")]


def test_vllm_gets_the_same_kv_tokens_at_its_own_dtypes_bytes(tmp_path, monkeypatch):
    from benchmarks import peers_bench

    specs = []
    monkeypatch.setattr(peers_bench, "run_peer_script", lambda name, python, script, spec, *rest: specs.append(spec))
    monkeypatch.setattr(peers_bench, "peer_python", lambda config: tmp_path / "python")
    for precision, token_bytes in (("bf16", 23_040), ("fp32", 46_080)):
        peers_bench._run_peer("vllm", PeersBenchConfig(), tmp_path, tmp_path, [], 2_330, token_bytes, precision,
                              tmp_path, "vllm", None)
    assert [(spec["dtype"], spec["kv_cache_bytes"]) for spec in specs] == [
        ("bfloat16", 2_330 * 23_040), ("float32", 2_330 * 46_080)]


def test_the_kv_bytes_reported_for_a_peer_follow_its_cache_dtype():
    from benchmarks.peers_bench import peer_kv_token_bytes

    ours, bf16 = 46_080, 23_040  # SmolLM2's fp32 and bf16 KV bytes per token
    assert [peer_kv_token_bytes(system, precision, ours, bf16) for system, precision in (
        ("vllm", "fp32"), ("vllm", "bf16"), ("openvino", "fp32+f16w"), ("openvino", "bf16"), ("llamacpp", "bf16"),
        ("llamacpp", "q4_1"))] == [ours, bf16, ours, bf16, bf16, bf16]


def test_an_unknown_system_or_a_missing_peer_environment_fails_before_anything_loads(tmp_path):
    with pytest.raises(ValueError, match="--systems takes"):
        run(PeersBenchConfig(systems=("sglang",)))
    with pytest.raises(ValueError, match="make peers"):
        run(PeersBenchConfig(systems=("llamacpp",), peer_venv=tmp_path))
    with pytest.raises(ValueError, match="make peers"):
        run(PeersBenchConfig(systems=("openvino",), openvino_venv=tmp_path))
